"""2. Terms, communication: alpha-beta collectives per network tier (ring all-reduce / reduce-scatter / all-gather,
flat and hierarchical all-to-all, p2p; measured tier-0 numbers when the calibration has them), overlap, and the
tensor- and context-parallel communication of a sub-layer."""

from __future__ import annotations

from moestack.config.cluster import ClusterSpec
from moestack.config.plan import Plan
from moestack.planner.calibration import CommCalibration
from moestack.planner.cost.compute import kda_scan_widen_factor
from moestack.planner.cost.context import Ctx
from moestack.planner.cost.work import BF16, FP32, PartWork

# Fraction of an "overlapped" collective that still shows (imperfect overlap: launch gaps, SM contention).
OVERLAP_RESIDUAL = 0.15


def group_members_per_domain(cluster: ClusterSpec, size: int, stride: int, tier: int) -> int:
    """Members of a process group (ranks r0 + j * stride, j < size) inside one domain of `tier`."""
    domain = cluster.tier_domain(tier)
    if stride >= domain:
        return 1
    return min(size, domain // stride)


def group_tier(cluster: ClusterSpec, size: int, stride: int) -> int:
    """Innermost network tier whose domains contain a whole group (the link class its ring crosses)."""
    for i in range(len(cluster.tiers)):
        if group_members_per_domain(cluster, size, stride, i) >= size:
            return i
    return len(cluster.tiers) - 1


def _tier_bw(cluster: ClusterSpec, tier: int) -> float:
    """Datasheet bandwidth of a tier's links x its efficiency (bytes/s): the price of a collective when no
    measured number applies (see `_measured`)."""
    t = cluster.tiers[tier]
    return t.bandwidth_gb_s * 1e9 * t.efficiency


def _measured(comm: CommCalibration | None, tier: int, kind: str) -> tuple[float, float] | None:
    """(bus bandwidth in bytes/s, per-call latency in s) of collective `kind` ("ar", "rs", "ag", "a2a") measured by
    `moestack tune-comm`, when the group runs inside tier 0 (the scale-up domain the measurement ran in) and the
    calibration has it; else None (datasheet path). Why measured numbers win: calibration.CommCalibration."""
    if comm is None or tier != comm.tier:
        return None
    c = comm.collectives.get(kind)
    if c is None:
        return None
    return c.busbw_gb_s * 1e9, c.latency_us * 1e-6


def ring_time(cluster: ClusterSpec, nbytes: float, size: int, stride: int, kind: str,
              comm: CommCalibration | None = None) -> float:
    """Ring collective over `size` ranks: reduce-scatter / all-gather move (n-1)/n of the buffer per rank,
    all-reduce twice that (Patarasuk & Yuan 2009; NCCL's busbw convention), at the bandwidth of the tier the
    group spans, plus one latency per ring step.

    With a measured `comm` (Calibration.comm) and a group inside tier 0: factor (n-1)/n * nbytes / measured busbw of
    this kind + the measured per-call latency (busbw is NCCL's convention, so the same factor converts it back)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    tier = group_tier(cluster, size, stride)
    factor = {"rs": 1.0, "ag": 1.0, "ar": 2.0}[kind]
    measured = _measured(comm, tier, kind)
    if measured is not None:
        bw, lat = measured
        return factor * (size - 1) / size * nbytes / bw + lat
    steps = (size - 1) * factor
    return factor * (size - 1) / size * nbytes / _tier_bw(cluster, tier) + steps * cluster.tiers[tier].latency_us * 1e-6


def a2a_time(cluster: ClusterSpec, nbytes: float, size: int, stride: int, hierarchical: bool, top_k: int,
             max_domains: int | None = None, comm: CommCalibration | None = None) -> float:
    """All-to-all where each rank sends `nbytes` spread uniformly over `size` ranks (expert dispatch or combine).

    Flat: the share for peers inside the rank's innermost domain goes over tier 0, the rest over the tier the group
    spans; links run concurrently, so the slower share sets the time. Hierarchical (DeepEP / HybridEP style): a
    token crosses to each remote domain once and is fanned out there, so the crossing bytes shrink by
    E[distinct remote domains hit] / E[remote copies] = G (1 - (1 - 1/G)^k) / k (uniform routing over G domains,
    capped by group-limited routing's `max_domains`).

    With a measured `comm` (Calibration.comm, kind "a2a") and a group inside tier 0: (n-1)/n * nbytes / measured
    busbw + the measured per-call latency. Groups spanning outer tiers keep the datasheet bandwidths.
    """
    if size <= 1 or nbytes <= 0:
        return 0.0
    if not cluster.tiers:
        return 0.0
    outer = group_tier(cluster, size, stride)
    local = group_members_per_domain(cluster, size, stride, 0)
    measured = _measured(comm, outer, "a2a")
    if measured is not None:
        bw, lat = measured
        return nbytes * (size - 1) / size / bw + lat
    lat = cluster.tiers[outer].latency_us * 1e-6 * 2
    if outer == 0:
        return nbytes * (size - 1) / size / _tier_bw(cluster, 0) + lat
    remote_frac = (size - local) / size
    if hierarchical:
        domains = size / local
        distinct = domains * (1.0 - (1.0 - 1.0 / domains) ** top_k)
        if max_domains is not None:
            distinct = min(distinct, max_domains)
        remote = nbytes / top_k * distinct * (domains - 1) / domains
        intra = nbytes * (1.0 - 1.0 / size)
    else:
        remote = nbytes * remote_frac
        intra = nbytes * (local - 1) / size
    return max(remote / _tier_bw(cluster, outer), intra / _tier_bw(cluster, 0)) + lat


def p2p_time(cluster: ClusterSpec, nbytes: float, stride: int) -> float:
    """One send between neighbouring pipeline stages `stride` ranks apart."""
    if nbytes <= 0 or not cluster.tiers:
        return 0.0
    tier = group_tier(cluster, 2, stride)
    return nbytes / _tier_bw(cluster, tier) + cluster.tiers[tier].latency_us * 1e-6


def _overlapped(comm: float, compute: float, overlap: bool) -> float:
    """Exposed part of a collective that can run under `compute` (imperfect: OVERLAP_RESIDUAL still shows)."""
    if not overlap:
        return comm
    return max(0.0, comm - compute) + OVERLAP_RESIDUAL * min(comm, compute)


def tp_grad_sum_bytes(part: PartWork, plan: Plan) -> float:
    """Gradient bytes of one part that moestack's TP all-reduces over the TP group in every backward: replicated
    weights used on part of the work (tensor.py "sum" / "avg": low-rank and MLA down-projections, the DSA indexer,
    the MoE router and latent projections, and the routed experts unless expert parallelism owns them). Gradients
    come in the compute dtype (bf16 under FSDP2 mixed precision), the router's in fp32. Norm weights are left out."""
    if plan.tp <= 1:
        return 0.0
    grad_b = FP32 if plan.precision == "fp32" else BF16
    total = 0.0
    for g in part.gemms:
        if g.expert:
            if _experts_tp_replicated(plan):
                total += g.params * part.num_experts * grad_b
        elif g.split == "rep":
            total += g.params * (FP32 if g.fp32 else grad_b)
    return total


def _experts_tp_replicated(plan: Plan) -> bool:
    """Routed experts replicated over the TP ranks (no EP / ETP): each rank runs them on its own tokens and the
    gradients are summed over TP in every backward (moestack/parallel/tensor.py)."""
    return plan.tp > 1 and plan.ep * plan.etp == 1


def tp_grad_sum_time(part: PartWork, ctx: Ctx) -> float:
    """Exposed seconds of those all-reduces for one micro-batch (moestack/parallel/tensor.py `_LocalView`)."""
    nbytes = tp_grad_sum_bytes(part, ctx.plan)
    return ring_time(ctx.cluster, nbytes, ctx.plan.tp, 1, "ar", ctx.cal.comm) if nbytes else 0.0


def tp_comm_times(plan: Plan, coll: float, g_fwd: float) -> tuple[float, float]:
    """(fwd, bwd) exposed seconds of one sub-layer's TP collectives; `coll` is one all-gather of its input.

    Sequence parallel: forward all-gather in + reduce-scatter out, backward the same + the re-gather of the input
    for wgrad (Korthikanti et al. 2022, Sec. 4.2.2): 2 and 3 collectives. Plain TP: one all-reduce (= reduce-scatter +
    all-gather) each way, no re-gather. plan.tp_comm_overlap: hidden behind the part's GEMMs (Megatron's userbuffers
    overlap; OVERLAP_RESIDUAL still shows); moestack's trainer runs them on the compute stream, so the search leaves
    the overlap off (search.TP_OVERLAP_DEFAULT)."""
    f, b = (2 * coll, 3 * coll) if plan.sequence_parallel else (2 * coll, 2 * coll)
    if plan.tp_comm_overlap:
        return _overlapped(f, g_fwd, True), _overlapped(b, 2 * g_fwd, True)
    return f, b


def _cp_times(part: PartWork, ctx: Ctx, core_f: float, core_b: float, rec_f: float = 0.0, rec_b: float = 0.0
              ) -> tuple[float, float]:
    """Exposed CP time of one sub-layer: (fwd, bwd), from the term of its kind (core_*: the attention core's time,
    rec_*: the recurrence's own time on this rank's shard)."""
    if part.kind in ("mla", "gqa"):
        return cp_attention_times(part, ctx, core_f, core_b)
    if part.kind == "kda" and ctx.plan.cp_kda == "scan":
        return cp_kda_scan_times(part, ctx, rec_f, rec_b)
    if part.kind in ("kda", "mamba2"):
        return cp_relay_times(part, ctx, rec_f, rec_b)
    return 0.0, 0.0


def cp_attention_times(part: PartWork, ctx: Ctx, core_f: float, core_b: float) -> tuple[float, float]:
    """Attention under CP: the all-gather of the MLA latent (and DSA indexer key; GQA: keys and values) over the
    cp ranks, hidden behind the attention core; backward reduce-scatters the gradient (twice the traffic)."""
    plan, cluster, spec = ctx.plan, ctx.cluster, ctx.spec
    if part.kind == "gqa":
        assert spec.gqa is not None
        kv = 2 * spec.gqa.num_kv_heads * spec.gqa_head_dim * BF16
    else:
        assert spec.mla is not None
        kv = (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) * BF16  # MQA latent, shared by all heads
        if spec.mla.indexer is not None:
            kv += spec.mla.indexer.head_dim * BF16  # the indexer key, gathered too
    if part.window is not None and part.window < ctx.tokens:
        # sliding window: a rank's queries reach back `window` keys, all on the previous shard: one send of the
        # window's keys and values per sequence, not the all-gather (ctx.tokens is the rank's shard)
        comm = p2p_time(cluster, plan.micro_batch_size * part.window * kv, plan.tp)
    else:
        comm = ring_time(cluster, plan.cp * ctx.tokens * kv, plan.cp, plan.tp, "ag", ctx.cal.comm)
    return _overlapped(comm, core_f, True), _overlapped(2 * comm, core_b, True)


def _state_bytes(part: PartWork, ctx: Ctx) -> float:
    """One rank's recurrent state (fp32), per sequence of the micro-batch."""
    spec = ctx.spec
    if part.kind == "kda":
        assert spec.kda is not None
        return spec.kda.value_heads * spec.kda.head_dim**2 * FP32 / ctx.plan.tp
    assert spec.mamba2 is not None
    return spec.mamba2.inner_size * spec.mamba2.state_size * FP32 / ctx.plan.tp


def cp_relay_times(part: PartWork, ctx: Ctx, rec_f: float, rec_b: float) -> tuple[float, float]:
    """KDA / Mamba-2 state relay (plan.cp_kda = relay): rank r starts after ranks 0..r-1 finished theirs, so a
    micro-batch waits cp - 1 shards' recurrence plus cp - 1 state hops, forward and backward (no micro-batch fills
    the wait outside a pipeline schedule)."""
    cp = ctx.plan.cp
    hop = p2p_time(ctx.cluster, _state_bytes(part, ctx), ctx.plan.tp)
    return (cp - 1) * (hop + rec_f), (cp - 1) * (hop + rec_b)


def cp_kda_scan_times(part: PartWork, ctx: Ctx, rec_f: float, rec_b: float) -> tuple[float, float]:
    """KDA state scan (plan.cp_kda = scan): every rank runs its shard at once. Exposed: the widened pass's extra
    compute, the all-gather of the cp transitions [M | S_loc] (fp32, H*K*(K+V) per sequence and rank; backward a
    reduce-scatter) on the critical path, and the correction q_hat S_in plus the prefix composition (plain matmuls).
    The short-conv halo all-gather (W-1 rows) is negligible."""
    plan, cluster, spec = ctx.plan, ctx.cluster, ctx.spec
    assert spec.kda is not None
    Hv, d, cp = spec.kda.value_heads / plan.tp, spec.kda.head_dim, plan.cp
    extra = kda_scan_widen_factor(d, spec.kda.chunk_size) - 1.0
    seqs = plan.micro_batch_size
    gather = ring_time(cluster, cp * seqs * 2 * _state_bytes(part, ctx), cp, plan.tp, "ag", ctx.cal.comm)
    flops = 2 * ctx.tokens * Hv * d * d + seqs * (cp - 1) * Hv * 2 * d * d * d  # correction + composition
    mm = flops / (cluster.device.peak_flops("bf16") * ctx.cal.gemm_peak_eff)
    return extra * rec_f + gather + mm, extra * rec_b + 2 * gather + 2 * mm
