"""Cost-model terms against loop-clear references and against the profile (the single source of parameter counts).

Every check can fail: parameters/FLOPs must match profile.py layer by layer, closed forms are compared with brute
force, the pipeline formula with an independent list-scheduling simulation, and calibration constants with the
MEASURED.md numbers they claim to fit.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from moestack.config.cluster import load_cluster_spec
from moestack.config.plan import OffloadPolicy, RecomputePolicy, make_plan, runtime_unsupported
from moestack.planner.calibration import load_calibration
from moestack.planner.cost.comm import a2a_time, group_tier, p2p_time, ring_time, tp_grad_sum_bytes, tp_grad_sum_time
from moestack.planner.cost.compute import dsa_head_block_factor
from moestack.planner.cost.context import Ctx, PartCost
from moestack.planner.cost.memory import _saved_bytes
from moestack.planner.cost.parts import part_cost
from moestack.planner.cost.pipeline import balanced_chunks, inflight_microbatches, pipeline_time
from moestack.planner.cost.step import CostModel
from moestack.planner.cost.work import BF16, _causal_pairs, attn_res_elem_bytes, model_work
from moestack.planner.profile import load_any_model_spec, profile_model
from moestack.planner.report import simulate_pipeline


def test_kimi_k3_expert_share():
    """MODEL.md: routed experts are ~98% of K3's parameters; one expert is 33.03M."""
    work = model_work(load_any_model_spec("kimi-k3"), 4096)
    moe = next(p for lw in work.layers for p in lw.parts if p.kind == "moe")
    assert moe.expert_params / moe.num_experts == pytest.approx(33.03e6, rel=1e-3)
    assert work.expert_params / work.total_params == pytest.approx(0.98, abs=0.01)


@pytest.mark.parametrize("s,w", [(1, None), (7, None), (1000, None), (1000, 64), (64, 1000), (513, 512)])
def test_causal_pairs_brute_force(s, w):
    brute = sum(min(t, w) if w else t for t in range(1, s + 1)) / s
    assert _causal_pairs(s, w) == pytest.approx(brute, rel=1e-12)


def test_ring_and_a2a_against_hand_formulas():
    cl = load_cluster_spec("h100-cluster").with_devices(64)
    nv, ib = cl.tiers
    S = 512e6
    # 8 ranks inside a node: RS moves 7/8 of the buffer over NVLink, AR twice that
    t_rs = ring_time(cl, S, 8, 1, "rs")
    assert t_rs == pytest.approx(7 / 8 * S / (nv.bandwidth_gb_s * 1e9 * nv.efficiency) + 7 * nv.latency_us * 1e-6)
    t_ar = ring_time(cl, S, 8, 1, "ar")
    assert t_ar == pytest.approx(2 * 7 / 8 * S / (nv.bandwidth_gb_s * 1e9 * nv.efficiency) + 14 * nv.latency_us * 1e-6)
    # stride 8: one rank per node -> IB
    assert group_tier(cl, 8, 8) == 1 and group_tier(cl, 8, 1) == 0 and group_tier(cl, 4, 2) == 0
    assert ring_time(cl, S, 8, 8, "rs") > t_rs * (nv.bandwidth_gb_s / ib.bandwidth_gb_s) * 0.9
    assert ring_time(cl, S, 1, 1, "ar") == 0.0
    # flat a2a over 64 ranks = 8 nodes: 56/64 of the bytes leave the node over IB
    flat = a2a_time(cl, S, 64, 1, False, 8)
    expect = max(S * 56 / 64 / (ib.bandwidth_gb_s * 1e9 * ib.efficiency),
                 S * 7 / 64 / (nv.bandwidth_gb_s * 1e9 * nv.efficiency)) + 2 * ib.latency_us * 1e-6
    assert flat == pytest.approx(expect)
    hier = a2a_time(cl, S, 64, 1, True, 8)
    assert hier < flat
    # hierarchical dedup: distinct remote nodes among 8 uniform picks over 8 nodes
    G, k = 8, 8
    distinct = G * (1 - (1 - 1 / G) ** k)
    remote = S / k * distinct * (G - 1) / G
    assert hier == pytest.approx(max(remote / (ib.bandwidth_gb_s * 1e9 * ib.efficiency),
                                     S * (1 - 1 / 64) / (nv.bandwidth_gb_s * 1e9 * nv.efficiency))
                                 + 2 * ib.latency_us * 1e-6)
    # group-limited routing (<= 4 nodes) caps the crossings further
    assert a2a_time(cl, S, 64, 1, True, 8, max_domains=4) < hier


def test_expected_distinct_domains_monte_carlo():
    """The dedup factor G(1-(1-1/G)^k) against sampling."""
    rng = random.Random(0)
    G, k = 6, 5
    trials = 20000
    mean = sum(len({rng.randrange(G) for _ in range(k)}) for _ in range(trials)) / trials
    assert mean == pytest.approx(G * (1 - (1 - 1 / G) ** k), rel=0.02)


def _brute_partition(costs, n, first, last):
    L = len(costs)
    best = math.inf
    for cuts in itertools.combinations(range(1, L), n - 1):
        b = (0, *cuts, L)
        loads = [sum(costs[b[i]:b[i + 1]]) for i in range(n)]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_balanced_chunks_is_optimal(seed):
    rng = random.Random(seed)
    L = rng.randint(4, 11)
    n = rng.randint(1, L)
    costs = [rng.uniform(0.2, 3.0) for _ in range(L)]
    first, last = rng.uniform(0, 2), rng.uniform(0, 4)
    chunks = balanced_chunks(costs, n, first, last)
    assert [i for ch in chunks for i in ch] == list(range(L)) and all(chunks) and len(chunks) == n
    loads = [sum(costs[i] for i in ch) for ch in chunks]
    loads[0] += first
    loads[-1] += last
    assert max(loads) == pytest.approx(_brute_partition(costs, n, first, last), rel=1e-3)


def test_pipeline_formulas():
    F, B = 1.0, 2.0
    assert pipeline_time("1f1b", 4, 1, 8, F, B, 1.0) == pytest.approx((8 + 3) * 3.0)
    assert pipeline_time("interleaved_1f1b", 4, 2, 8, F, B, 1.0) == pytest.approx((8 + 3 / 2) * 3.0)
    # zero-bubble V with F = B_input = W: no bubble
    assert pipeline_time("zbv", 4, 2, 8, 1.0, 2.0, 1.0) == pytest.approx(8 * 3.0)
    assert pipeline_time("1f1b", 1, 1, 5, F, B, 1.0) == pytest.approx(15.0)
    assert inflight_microbatches("1f1b", 8, 1, 32) == 8
    assert inflight_microbatches("interleaved_1f1b", 8, 4, 64) == pytest.approx((32 + 7) / 4)
    assert inflight_microbatches("gpipe", 8, 1, 32) == 32


def _model(name="proxy", cluster="h200-cluster", devices=8, seq=4096):
    spec = load_any_model_spec(name)
    cl = load_cluster_spec(cluster).with_devices(devices)
    prof = profile_model(spec, seq)
    return CostModel(spec, cl, load_calibration(), seq, prof.train_flops_per_token)


def _plan(**kw):
    base = dict(model="proxy", cluster="h200-cluster", devices=8, seq_len=4096, global_batch_size=64)
    base.update(kw)
    return make_plan(**base)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 1)])
def test_pipeline_formula_matches_simulation(schedule, v):
    """Closed-form pipeline time vs an independent list-scheduled simulation of the same per-rank times."""
    cm = _model(devices=8)
    plan = _plan(pp=4, vpp=v, schedule=schedule, dp_shard=2, zero_stage=1, global_batch_size=16)
    c = cm.evaluate(plan)
    m = plan.num_microbatches
    boxes = simulate_pipeline(c, m)
    span = max(e for _, _, e, _, _ in boxes)
    slow = max(range(4), key=lambda r: sum(c.rank_fwd_bwd[r][:2]))
    f, b, w = c.rank_fwd_bwd[slow]
    formula = pipeline_time(schedule, 4, v, m, f, b, w)
    assert span == pytest.approx(formula, rel=0.12)


def test_memory_responds_to_sharding_recompute_offload():
    cm = _model(devices=8)
    base = cm.evaluate(_plan(dp_shard=8, zero_stage=1))
    z3 = cm.evaluate(_plan(dp_shard=8, zero_stage=3))
    # FSDP2 shards the fp32 weights at both stages (4 / 8 bytes per parameter); ZeRO-1 adds the bf16 copy kept from
    # forward to backward (2 bytes), ZeRO-3 gathers it per layer (buffers)
    assert z3.memory["weights"] == pytest.approx(base.memory["weights"] * 0.5 / (0.5 + 2), rel=0.01)
    assert base.memory["optimizer"] == pytest.approx(
        cm.evaluate(_plan(dp_replicate=8)).memory["optimizer"] / 8, rel=0.01)
    full = cm.evaluate(_plan(dp_shard=8, zero_stage=1, recompute=RecomputePolicy.uniform("full")))
    sel = cm.evaluate(_plan(dp_shard=8, zero_stage=1, recompute=RecomputePolicy.uniform("selective")))
    assert full.memory["activations"] < sel.memory["activations"] < base.memory["activations"]
    assert full.step_time_s > sel.step_time_s > base.step_time_s
    off = cm.evaluate(_plan(dp_shard=8, zero_stage=1, offload=OffloadPolicy(optimizer=True)))
    assert off.memory["optimizer"] == 0 and off.host_bytes > 0
    assert off.memory["weights"] == pytest.approx(base.memory["weights"] * 2 / 2.5, rel=0.01)  # bf16 copy only


def test_fp8_weight_cache_memory():
    """precision fp8 holds both fp8 layouts (2 bytes per parameter) of every FP8 GEMM's weight until the optimizer
    step; under ZeRO-3 only the gathered layer's (the cache drops what FSDP frees)."""
    cm = _model(devices=8)
    bf16 = cm.evaluate(_plan(dp_shard=8, zero_stage=1))
    fp8 = cm.evaluate(_plan(dp_shard=8, zero_stage=1, precision="fp8"))
    work = cm.work
    gemm_params = sum(sum(cm._part_params_local(p, _plan(dp_shard=8, zero_stage=1))) for lw in work.layers
                      for p in lw.parts)
    assert fp8.memory["fp8_weights"] == pytest.approx(2 * gemm_params, rel=0.02) and "fp8_weights" not in bf16.memory
    assert fp8.memory["weights"] == bf16.memory["weights"]
    z3 = cm.evaluate(_plan(dp_shard=8, zero_stage=3, precision="fp8"))
    assert z3.memory["fp8_weights"] == pytest.approx(2 * gemm_params / len(work.layers), rel=0.02)


def test_ep_and_tp_split_memory():
    cm = _model(devices=8)
    e1 = cm.evaluate(_plan(dp_shard=8, zero_stage=1))
    e8 = cm.evaluate(_plan(dp_shard=8, zero_stage=1, ep=8))
    work = cm.work
    # per expert parameter: ep 1 shards the fp32 weights over dp 8 and holds the whole bf16 copy (4/8 + 2 bytes);
    # ep 8 holds 1/8 of the experts, unsharded (edp 1): (4 + 2) / 8
    per_param = (4 / 8 + 2) - (4 + 2) / 8
    assert e1.memory["weights"] - e8.memory["weights"] == pytest.approx(work.expert_params * per_param, rel=0.01)
    t2 = cm.evaluate(_plan(tp=2, dp_shard=4, zero_stage=1))
    assert t2.memory["activations"] < e1.memory["activations"]


def test_model_flops_and_mfu_definition():
    cm = _model(devices=8)
    c = cm.evaluate(_plan(dp_shard=8, zero_stage=1))
    tokens = 64 * 4096
    assert c.model_flops_per_step == pytest.approx(cm.model_flops_per_token * tokens)
    assert c.tflops_per_device == pytest.approx(c.model_flops_per_step / c.step_time_s / 8 / 1e12)
    assert c.mfu == pytest.approx(c.tflops_per_device / 989.4)
    assert sum(c.memory.values()) == pytest.approx(c.memory_total)


def test_calibration_reproduces_measured_points():
    """calibration.py claims its 3 constants fit MEASURED.md's GEMMs; check each within 10% (15% at 64 tok)."""
    cal = load_calibration()
    peak = 989.4
    cases = [  # (tokens, n, k, grouped, measured TFLOP/s)
        (8192, 8192, 8192, False, 758), (2048, 3072, 3584, True, 666), (2341, 1024, 2048, True, 488),
        (586, 512, 1024, True, 328), (8192, 2048, 4096, True, 559),
    ]
    for t, n, k, g, meas in cases:
        pred = cal.gemm_efficiency(t, n, k, grouped=g) * peak
        assert pred == pytest.approx(meas, rel=0.10), (t, n, k, pred, meas)
    # "grouped GEMM vs tokens per expert (other measurement)": ranges; the fit must land within 10% of the range
    for t, lo, hi in ((256, 650, 760), (128, 350, 430), (64, 176, 211)):
        pred = cal.gemm_efficiency(t, 3072, 3584, grouped=True) * peak
        assert 0.9 * lo <= pred <= 1.1 * hi, (t, pred)
    # FP8 grouped GEMM 993 TFLOP/s at the K3 expert shape (MEASURED.md)
    assert cal.gemm_efficiency(2048, 3072, 3584, "fp8", True) * 1978.9 == pytest.approx(993, rel=0.05)
    # KDA: 2.0e11 FLOPs (K3 heads, B2 T8192) in 5.76 ms forward
    flops = 96 * (6 * 128**2 + 3 * 64 * 128 + 64**2) * 2 * 8192
    assert flops / (peak * 1e12 * cal.kda_fwd_eff) == pytest.approx(5.76e-3, rel=0.05)


# --- tensor parallelism as moestack/parallel/tensor.py runs it (issue #10: tp2 on the proxy) ---------------------


def _part(cm, plan, kind):
    kc, kinds, _ = cm.kind_costs(plan)
    ctx = Ctx(plan, cm.spec, cm.cluster, cm.cal, plan.micro_batch_size * plan.seq_len / plan.cp)
    part = next(p for lw in kinds for p in lw.parts if p.kind == kind)
    return part, part_cost(part, ctx)


def test_tp_dsa_sparse_attention_pays_per_64_head_block():
    """The DSA kernels run up to 64 heads of a token in one program: 20 heads / tp2 cost what 20 heads cost, 96 / tp2
    (48) what 96 (two blocks) cost halved; a calibration measured at 10 heads prices 20 heads at the same time."""
    assert dsa_head_block_factor(20, 2, None) == 1.0
    assert dsa_head_block_factor(20, 1, None) == 1.0
    assert dsa_head_block_factor(96, 2, None) == pytest.approx(0.5)
    assert dsa_head_block_factor(128, 4, None) == pytest.approx(0.5)
    assert dsa_head_block_factor(20, 1, 10) == pytest.approx(0.5)  # flops of 20 heads at 10 heads' efficiency
    # the proxy (20 MLA heads): the whole attention term (sparse attention + replicated indexer) is the same at tp2
    cm = _model(devices=2)
    one = _part(cm, _plan(devices=1, global_batch_size=4, micro_batch_size=2), "mla")[1]
    two = _part(cm, _plan(devices=2, tp=2, global_batch_size=4, micro_batch_size=2), "mla")[1]
    assert two.parts["attention"] == pytest.approx(one.parts["attention"], rel=1e-12)
    assert two.parts["gemm"] < one.parts["gemm"]  # the head-split projections still halve


def test_tp_dsa_indexer_activations_replicated():
    """The indexer runs on the whole sequence on every TP rank: its saved bytes are not divided by tp."""
    work = model_work(load_any_model_spec("proxy"), 4096)
    mla = next(p for lw in work.layers for p in lw.parts if p.kind == "mla")
    idx = load_any_model_spec("proxy").mla.indexer
    assert mla.act_replicated >= idx.top_k * 4 + idx.num_heads * idx.head_dim * 2


def test_tp_measured_activations_keep_the_replicated_share():
    """A tuned part's measured bytes per token divide by tp except the replicated share (latents, indexer)."""
    from moestack.planner.calibration import PartCalibration

    cm = _model(devices=2)
    cm.cal = cm.cal.model_copy(update={"parts": {"mla": PartCalibration(
        tokens=4096, fwd_extra_s_per_token=0.0, bwd_extra_s_per_token=0.0, act_bytes_per_token=100_000.0)}})
    plan = _plan(devices=2, tp=2, global_batch_size=4, micro_batch_size=1)
    part, cost = _part(cm, plan, "mla")
    rep = part.act_replicated
    assert 0 < rep < 100_000
    assert _saved_bytes(part, "none", Ctx(plan, cm.spec, cm.cluster, cm.cal, 4096)) == pytest.approx(
        4096 * ((100_000 - rep) / 2 + rep))


def test_tp_moe_router_and_latent_replicated_on_the_shard():
    """Token-sharded MoE: router and latent projections are whole on every TP rank (parameters not divided by tp)
    and run on T / tp rows; only the shared experts split."""
    cm = _model(devices=2)
    part = next(p for lw in cm.work.layers for p in lw.parts if p.kind == "moe")
    g = {x.name: x for x in part.gemms}
    for name in ("moe.router", "moe.down", "moe.up"):
        assert g[name].split == "rep" and g[name].seq_shard
    d1, _ = cm._part_params_local(part, _plan(devices=1, global_batch_size=4))
    d2, e2 = cm._part_params_local(part, _plan(devices=2, tp=2, global_batch_size=4))
    shared = sum(x.params for x in part.gemms if x.name.startswith("shared."))
    assert d1 - d2 == pytest.approx(shared / 2)
    assert e2 == part.expert_params  # no EP: every TP rank holds all experts


def test_tp_gradient_sums_every_micro_batch():
    """Replicated weights used on part of the work are all-reduced over TP in every backward (tensor.py
    `_LocalView`): for the MoE the routed experts (without EP; bf16), router (fp32) and latent projections; with
    EP the experts are not TP's. The LM head's [V, h] gradient likewise; the expert DP reduction then runs over dp."""
    cm = _model(devices=2)
    p_ep1 = _plan(devices=2, tp=2, global_batch_size=4, micro_batch_size=2)
    p_ep2 = _plan(devices=2, tp=2, ep=2, global_batch_size=4, micro_batch_size=2)
    part, c1 = _part(cm, p_ep1, "moe")
    _, c2 = _part(cm, p_ep2, "moe")
    g = {x.name: x for x in part.gemms}
    want = part.expert_params * 2 + g["moe.router"].params * 4 + (g["moe.down"].params + g["moe.up"].params) * 2
    assert tp_grad_sum_bytes(part, p_ep1) == want
    assert tp_grad_sum_bytes(part, p_ep2) == want - part.expert_params * 2
    ar = ring_time(cm.cluster, want, 2, 1, "ar")
    ar_ep2 = ring_time(cm.cluster, want - part.expert_params * 2, 2, 1, "ar")
    assert c1.parts["tp_comm"] - c2.parts["tp_comm"] == pytest.approx(ar - ar_ep2)
    assert tp_grad_sum_bytes(part, _plan(devices=1, global_batch_size=4)) == 0.0
    head = cm.head_cost(p_ep1)
    assert head.parts["tp_comm"] == pytest.approx(ring_time(cm.cluster, cm.work.head.params * 2, 2, 1, "ar"))
    # no second, once-per-step expert reduction over the TP ranks (dp = 1)
    assert cm.evaluate(p_ep1).time.get("dp_comm", 0.0) == 0.0


def test_deferred_tp_gradient_sums_once_per_step():
    """plan.tp_grad_reduce = deferred: no TP gradient all-reduce in the micro-batches' backward (parts or head), one
    per step over the rank's partial gradients in fp32 (FSDP's reduce dtype), whatever the micro-batch count."""
    cm = _model(devices=2)
    eager = _plan(devices=2, tp=2, global_batch_size=8, micro_batch_size=2)
    deferred = eager.model_copy(update={"tp_grad_reduce": "deferred"})
    part, c_e = _part(cm, eager, "moe")
    _, c_d = _part(cm, deferred, "moe")
    assert c_e.parts["tp_comm"] - c_d.parts["tp_comm"] == pytest.approx(tp_grad_sum_time(part, Ctx(
        eager, cm.spec, cm.cluster, cm.cal, 2 * 2048)))  # fmt: skip
    assert cm.head_cost(deferred).parts["tp_comm"] == 0.0 < cm.head_cost(eager).parts["tp_comm"]
    t_e, t_d = cm.evaluate(eager), cm.evaluate(deferred)
    assert "tp_grad_sum" not in t_e.time and t_d.time["tp_grad_sum"] > 0
    nbytes = sum(tp_grad_sum_bytes(p, eager) for layer in cm.work.layers for p in layer.parts)
    nbytes += cm.work.head.params * 2
    assert t_d.time["tp_grad_sum"] == pytest.approx(ring_time(cm.cluster, nbytes * 2, 2, 1, "ar", cm.cal.comm),
                                                    rel=1e-6)  # fmt: skip
    more_mb = cm.evaluate(deferred.model_copy(update={"global_batch_size": 16}))
    assert more_mb.time["tp_grad_sum"] == pytest.approx(t_d.time["tp_grad_sum"])


def test_tp_collectives_exposed_and_fsdp_bf16_copy():
    """moestack's TP collectives run on the compute stream: plan.tp_comm_overlap (Megatron's userbuffers overlap, for
    published runs) hides them behind the GEMMs in the model, and the trainer refuses it. A distributed ZeRO-0 plan
    (FSDP2 on one shard) holds the bf16 compute copy of its parameters on top of the fp32 ones."""
    cm = _model(devices=2)
    on_plan = _plan(devices=2, tp=2, ep=2, global_batch_size=4, micro_batch_size=2, tp_comm_overlap=True)
    on = cm.evaluate(on_plan)
    off = cm.evaluate(_plan(devices=2, tp=2, ep=2, global_batch_size=4, micro_batch_size=2, tp_comm_overlap=False))
    assert 0 < on.time["tp_comm"] < 0.5 * off.time["tp_comm"]
    assert any("tp_comm_overlap" in r for r in runtime_unsupported(on_plan))
    plan = _plan(devices=2, tp=2, global_batch_size=4, micro_batch_size=2, zero_stage=0)
    c = cm.evaluate(plan)
    d = sum(cm._part_params_local(p, plan)[0] for lw in cm.work.layers for p in lw.parts)
    e = sum(cm._part_params_local(p, plan)[1] for lw in cm.work.layers for p in lw.parts)
    d += cm.work.embed_params / 2 + (0 if cm.spec.tie_word_embeddings else cm.work.head.params / 2)
    assert c.memory["weights"] == pytest.approx((d + e) * 6, rel=0.01)
    assert c.memory["gradients"] == pytest.approx((d + e) * 4, rel=0.01)


def test_bwd_ws_factors_scale_the_end_of_backward_and_are_validated():
    """Calibration.bwd_ws_factors multiply the first layer's backward working set at the end of a one-device
    backward (full recompute: the end binds), which leaves out the embedding's gradient; unknown kinds are errors."""
    from moestack.config.base import ConfigError, validate
    from moestack.planner.calibration import Calibration

    spec = load_any_model_spec("proxy")
    base = load_calibration().model_copy(update={"bwd_ws_factors": {}})
    full = {"kda": "full", "attention": "full", "moe": "full", "mlp": "full"}
    plan = make_plan(model="proxy", cluster="h200-1gpu", devices=1, seq_len=4096, micro_batch_size=1,
                     global_batch_size=1, recompute=full)
    mem = {}
    for f in (1.0, 2.0):
        cal = base.model_copy(update={"bwd_ws_factors": {"kda/dense": f}})
        flops = profile_model(spec, 4096).train_flops_per_token
        cm = CostModel(spec, load_cluster_spec("h200-1gpu"), cal, 4096, flops)
        mem[f] = cm.evaluate(plan).memory
    assert mem[2.0]["buffers"] == pytest.approx(2 * mem[1.0]["buffers"])  # the proxy's first layer: kda/dense
    assert mem[1.0]["gradients"] == pytest.approx(mem[1.0]["weights"] - spec.vocab_size * spec.hidden_size * 4)
    with pytest.raises(ConfigError):
        validate(Calibration, {**base.model_dump(), "bwd_ws_factors": {"kda/mamba": 1.1}}, "test")


def _proxy_cost(cal, devices, fix, precision="bf16"):
    import dataclasses

    from moestack.planner.search import evaluate_fixed, load_problem, parse_fix
    prob = load_problem("proxy", "h200-cluster", devices, 2048, 8192 if devices > 1 or "mbs=2" not in fix else 4096,
                        precision=precision)
    prob = dataclasses.replace(prob, cal=cal)
    return evaluate_fixed(prob, parse_fix(fix)).best


def test_host_floor_binds_only_when_the_device_is_faster():
    """Calibration.host: max(device, host) per rank and pass; one GPU at 4 x 2048 tokens stays device-bound, at
    2 x 2048 the host sets the step; EP adds ep_moe_s per MoE layer (15 of the proxy's 16 layers), the FP8 recipe
    fp8_layer_s per layer."""
    from moestack.planner.calibration import HostCalibration
    cal = load_calibration("benchmarks/calibration-proxy-h200.json")  # the proxy's tune on one H200
    off = cal.model_copy(update={"host": HostCalibration(layer_s=0.0, ep_moe_s=0.0, tp_layer_s=0.0)})
    four_on, four_off = _proxy_cost(cal, 1, "dp=1,zero=0"), _proxy_cost(off, 1, "dp=1,zero=0")
    assert four_on.step_time_s == pytest.approx(four_off.step_time_s)
    two = _proxy_cost(cal, 1, "dp=1,zero=0,mbs=2")
    assert two.time["host"] > 0 and two.step_time_s > _proxy_cost(off, 1, "dp=1,zero=0,mbs=2").step_time_s
    big = cal.model_copy(update={"host": HostCalibration(layer_s=1.0, ep_moe_s=0.0, tp_layer_s=0.0)})
    assert _proxy_cost(big, 1, "dp=1,zero=0,mbs=2").step_time_s == pytest.approx(16 * 1.0 + two.time["optimizer"])
    ep = cal.model_copy(update={"host": HostCalibration(layer_s=1.0, ep_moe_s=0.5, tp_layer_s=0.0)})
    ep_cost = _proxy_cost(ep, 2, "dp=2,ep=2,zero=1,mbs=2")
    assert ep_cost.step_time_s - ep_cost.time["optimizer"] - ep_cost.time.get("dp_comm", 0.0) == pytest.approx(
        16 * 1.0 + 15 * 0.5)
    # the FP8 recipe adds fp8_layer_s to every layer (its quantisers, cache lookups, autograd Functions); bf16 not
    fp8 = cal.model_copy(update={"host": HostCalibration(layer_s=1.0, ep_moe_s=0.0, tp_layer_s=0.0, fp8_layer_s=0.25)})
    fp8_cost = _proxy_cost(fp8, 1, "dp=1,zero=0,mbs=2", precision="fp8")
    assert fp8_cost.step_time_s == pytest.approx(16 * 1.25 + fp8_cost.time["optimizer"])
    assert _proxy_cost(fp8, 1, "dp=1,zero=0,mbs=2").step_time_s == pytest.approx(16 * 1.0 + two.time["optimizer"])


def test_fsdp_grads_build_up():
    """FSDP2 plans with one micro-batch build gradients up as activations are freed (peak: the loss phase)."""
    spec = load_any_model_spec("proxy")
    cal = load_calibration()
    cluster = load_cluster_spec("h200-cluster").with_devices(2)
    cm = CostModel(spec, cluster, cal, 2048, profile_model(spec, 2048).train_flops_per_token)
    ep = make_plan(model="proxy", cluster="h200-cluster", devices=2, seq_len=2048, micro_batch_size=2,
                   global_batch_size=4, dp_shard=2, ep=2, zero_stage=1)
    cost = cm.evaluate(ep)
    assert cost.memory["gradients"] < cost.forward_activations / 10  # only the head's at the loss-phase peak
    accum = cm.evaluate(ep.model_copy(update={"global_batch_size": 8}))  # 2 micro-batches: gradients persist
    assert accum.memory["gradients"] > 5 * 2**30


def test_gemm_efficiency_uses_measured_points_and_scales_bf16_ones_for_fp8():
    """A measured point within 25% wins over the analytic curve; an fp8 GEMM without an fp8 point takes the bf16
    point of its shape times fp8_gemm_factor (tune measures bf16 points and the recipe's factor), not the curve."""
    from moestack.planner.calibration import GemmPoint

    base = load_calibration().model_copy(update={"fp8_gemm_factor": 0.7})
    curve_bf16, curve_fp8 = base.gemm_efficiency(4096, 7168, 3584), base.gemm_efficiency(4096, 7168, 3584, "fp8")
    assert curve_fp8 == pytest.approx(0.7 * curve_bf16)
    cal = base.model_copy(update={"gemm_points": [GemmPoint(tokens=4096, n=7168, k=3584, efficiency=0.5)]})
    assert cal.gemm_efficiency(4500, 7168, 3584) == 0.5  # within 25%
    assert cal.gemm_efficiency(4500, 7168, 3584, "fp8") == pytest.approx(0.35)
    assert not base.gemm_points  # the default calibration: the curve only
    assert cal.gemm_efficiency(8192, 7168, 3584, "fp8") == base.gemm_efficiency(8192, 7168, 3584, "fp8")  # too far
    assert cal.gemm_efficiency(4096, 7168, 3584, "fp8", grouped=True) != pytest.approx(0.35)  # dense point only
    fp8_point = GemmPoint(tokens=4096, n=7168, k=3584, dtype="fp8", efficiency=0.45)
    cal = cal.model_copy(update={"gemm_points": [*cal.gemm_points, fp8_point]})
    assert cal.gemm_efficiency(4096, 7168, 3584, "fp8") == 0.45  # a measured fp8 point wins


def _attn_res_models(block_size: int = 2, devices: int = 8, seq: int = 4096):
    """The proxy (16 layers) without and with Attention Residuals (8 blocks of 2 layers)."""
    spec = load_any_model_spec("proxy")
    ar = spec.model_copy(update={"attn_res_block_size": block_size})
    cl = load_cluster_spec("h200-cluster").with_devices(devices)
    return [CostModel(s, cl, load_calibration(), seq, profile_model(s, seq).train_flops_per_token)
            for s in (spec, ar)]


def test_attention_residuals_priced_by_depth():
    """Each layer's two mixes read the completed blocks and the partial sum: deeper layers move more bytes; the
    parts carry the mixes' 2 x 2d parameters and the profile's counts agree."""
    plain, ar = _attn_res_models()
    spec, h = ar.spec, ar.spec.hidden_size
    layers = ar.work.layers
    for lw, base in zip(layers, plain.work.layers, strict=True):
        mix, ffn = spec.attn_res_sources(lw.index - 1)
        (pm, pf), (bm, bf) = lw.parts, base.parts
        assert pm.other_params - bm.other_params == 2 * h == pf.other_params - bf.other_params
        assert pm.elem_bytes - bm.elem_bytes == pytest.approx(attn_res_elem_bytes(h, mix))
        assert pf.elem_bytes - bf.elem_bytes == pytest.approx(attn_res_elem_bytes(h, ffn))
    assert spec.attn_res_sources(15) == (9, 9) and spec.attn_res_sources(14) == (8, 9)  # layer 14 closes block 7
    plan = _plan(dp_shard=8, zero_stage=1)
    a, b = ar.evaluate(plan), plain.evaluate(plan)
    assert a.step_time_s > b.step_time_s and a.memory["activations"] > b.memory["activations"]


def test_attention_residuals_pipeline_boundaries():
    """A boundary sends the stacked state of its n completed blocks + the partial sum: the p2p term is the sum over
    boundaries of 2 sends of n + 1 hidden states; each chunk holds the blocks it received and the stack it sent."""
    plain, ar = _attn_res_models()
    plan = _plan(pp=4, dp_shard=2, zero_stage=1, global_batch_size=16)
    a, b = ar.evaluate(plan), plain.evaluate(plan)
    chunks = a.layout.chunks
    msg = plan.micro_batch_size * plan.seq_len * ar.spec.hidden_size * BF16
    hop = lambda n: p2p_time(ar.cluster, msg * n, plan.devices // plan.pp)  # noqa: E731
    blocks = [ar.spec.attn_res_blocks_before(c[0]) for c in chunks[1:]]
    assert len(set(blocks)) > 1  # later boundaries carry more blocks
    assert a.time["pp_p2p"] == pytest.approx(2 * sum(hop(n + 1) for n in blocks), rel=1e-12)
    assert b.time["pp_p2p"] == pytest.approx(2 * 3 * hop(1), rel=1e-12)
    costs = [PartCost() for _ in range(plan.pp)]
    ar._add_boundary_state(costs, chunks, a.layout.chunk_rank, msg)
    want = [(blocks[c - 1] if c else 0) + (blocks[c] + 1 if c < 3 else 0) for c in range(4)]
    assert [pc.act / msg for pc in costs] == want and [pc.act_kept / msg for pc in costs] == want
