"""`moestack tune`: measure the efficiencies the cost model uses, on the local GPU, at the model's shapes.

What it measures (bf16 unless noted; medians of CUDA-event timings after warm-up):
  dense GEMMs      every distinct [tokens, k] @ [k, n] the plan produces (TP-split), forward
  grouped GEMMs    the expert GEMMs at the plan's tokens per expert (torch._grouped_mm), forward
  fp8 GEMM         the FP8 recipe's blockwise-scaled GEMMs (forward and dW, 8192^3) vs the bf16 GEMM ->
                  fp8_gemm_factor (the cost model scales bf16 points by it where it has no fp8 point)
  attention        F.scaled_dot_product_attention, causal, forward and forward+backward at the model's heads
  HBM              a large device copy -> hbm_eff
  KDA core        moestack.ops.kda.chunk_kda with the backend the dispatcher picks, at the model's heads and length
  sparse attn     moestack.ops.dsa.sparse_mqa_attention (the selected backend), k = the indexer's top-k
  indexer top-k   moestack.ops.dsa.indexer_topk_from_inputs -> topk_elems_per_s (after the scoring FLOPs)
  host floor      with --measure-host: the whole model's forward + backward of one 256-token micro-batch, wall
                  clock, over its layers -> host.layer_s (tune/host.py; ep_moe_s and tp_layer_s keep
                  their defaults; opt-in until checked on a GPU); on an FP8 GPU the same pass on the FP8 recipe
                  -> host.fp8_layer_s (the difference per layer); the same pass with compiled blocks ->
                  host_modes["blocks"] (the host profile of plans that run TrainSpec.compile blocks)
Efficiencies are counted with the cost model's own FLOP formulas (planner/cost/), so a slow backend shows up as a
low efficiency and the step-time prediction follows the code that actually runs. CPU Adam keeps the default
calibration's value; the file says so in `source`. The measured GEMM points go into `gemm_points`, which the cost model
uses for shapes within 25%. Without a CUDA GPU it is an error (one line, exit 2): there is nothing to measure.
"""

from __future__ import annotations

import math
from pathlib import Path

from moestack.config.base import ConfigError
from moestack.planner.calibration import (
    Calibration,
    GemmPoint,
    HostCalibration,
    PartCalibration,
    load_calibration,
    save_calibration,
)

HOST_BOUND_GROWTH = 0.10  # wall-time growth at 2x tokens above which the host measurement is only an upper bound


def _bench(fn, warmup: int = 5, reps: int = 20) -> float:
    """Median seconds of fn() on the current CUDA device."""
    from moestack.tune.timer import median_seconds

    return median_seconds(fn, reps=reps, warmup=warmup)


def measure_gemm(tokens: int, n: int, k: int, peak: float) -> float:
    import torch

    a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    t = _bench(lambda: a @ b)
    return min(1.0, 2.0 * tokens * n * k / t / peak)


def measure_grouped(experts: int, tokens_per_expert: int, n: int, k: int, peak: float) -> float | None:
    import torch

    gmm = getattr(torch, "_grouped_mm", None)
    if gmm is None:
        return None
    tpe = max(16, int(math.ceil(tokens_per_expert / 16) * 16))  # grouped_mm wants 16-aligned offsets
    x = torch.randn(experts * tpe, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
    offs = torch.arange(tpe, experts * tpe + 1, tpe, device="cuda", dtype=torch.int32)
    try:
        t = _bench(lambda: gmm(x, w, offs=offs))
    except RuntimeError:  # layout / dtype not supported by this build
        return None
    return min(1.0, 2.0 * experts * tpe * n * k / t / peak)


def measure_fp8_factor(peak_bf16: float, peak_fp8: float) -> float | None:
    """fp8_gemm_factor: the efficiency of the GEMMs `precision: fp8` runs (DeepSeek-V3's blockwise scales through
    moestack/ops/fp8/scaled_mm.py: forward / dX with 1x128 x 128x128 scales, dW with 1x128 x 1x128), weighted
    2 : 1 as a training step runs them, over the bf16 GEMM's, both at 8192^3. Not a rowwise-scaled GEMM: that one
    runs at bf16's efficiency, which the recipe does not reach (benchmarks/RESULTS.md, "The FP8 recipe in the
    planner"). None where the per-expert cuBLAS path does not run (the recipe's Triton kernels take over; the
    default factor stays)."""
    import torch

    from moestack.ops.fp8 import quant as fq
    from moestack.ops.fp8 import scaled_mm as fsm

    device = torch.device("cuda")
    if not fsm.available(device):
        return None
    m = n = k = 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(1, n, k, device=device, generator=g) / k**0.5).to(torch.bfloat16).transpose(1, 2)  # [1, K, N]
    dy = torch.randn(m, n, device=device, generator=g, dtype=torch.bfloat16)
    offs = torch.tensor([m], device=device, dtype=torch.int32)
    qx, sx, qxT, sxT = fq.quantize_dual(x, offs, expert_major=True)
    (qw, sw), (_, swT) = fq.quantize_blocks_pair(w)
    _, _, qdyT, sdyT = fq.quantize_dual(dy, offs, expert_major=True)
    t_fwd = _bench(lambda: fsm.rows_mm(qx, sx, qw, sw, swT, [m], torch.bfloat16))
    t_dw = _bench(lambda: fsm.wgrad(qxT, sxT, qdyT, sdyT, [m], like=w))
    eff8 = 2.0 * m * n * k / ((2 * t_fwd + t_dw) / 3) / peak_fp8
    return min(1.0, eff8 / measure_gemm(m, n, k, peak_bf16))


def measure_sdpa(heads: int, seq: int, dim: int, peak: float) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    flops = 4.0 * heads * dim * seq * (seq + 1) / 2  # causal: QK^T and PV over (s+1)/2 keys per query
    t_f = _bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    grad = torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    t_fb = _bench(fwd_bwd)
    t_b = max(t_fb - t_f, 1e-9)
    return min(1.0, flops / t_f / peak), min(1.0, 2.5 * flops / t_b / peak)


def measure_kda(heads: int, dim: int, chunk: int, tokens: int, peak: float) -> tuple[float, float, str]:
    """Forward and backward efficiency of the chunked KDA core with the dispatcher's backend (bf16 inputs)."""
    import torch
    import torch.nn.functional as F

    from moestack.ops import kda

    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    q = F.normalize(rand(1, tokens, heads, dim), dim=-1).bfloat16().requires_grad_()
    k = F.normalize(rand(1, tokens, heads, dim), dim=-1).bfloat16().requires_grad_()
    v = rand(1, tokens, heads, dim).bfloat16().requires_grad_()
    gate = (-5 * torch.sigmoid(rand(1, tokens, heads, dim))).requires_grad_()
    beta = torch.sigmoid(rand(1, tokens, heads)).bfloat16().requires_grad_()
    do = rand(1, tokens, heads, dim).bfloat16()
    backend = kda.resolve_backend(None, q)
    flops = heads * (6 * dim * dim + 3 * chunk * dim + chunk * chunk) * tokens  # planner/cost/work.py kda_work
    t_f = _bench(lambda: kda.chunk_kda(q, k, v, gate, beta)[0], warmup=2, reps=5)
    t_fb = _bench(lambda: kda.chunk_kda(q, k, v, gate, beta)[0].backward(do), warmup=2, reps=5)
    t_b = max(t_fb - t_f, 1e-9)
    return min(1.0, flops / t_f / peak), min(1.0, 2 * flops / t_b / peak), backend


def measure_sparse_attention(heads: int, d_qk: int, d_v: int, top_k: int, tokens: int, peak: float
                             ) -> tuple[float, float, str]:
    """Forward and backward efficiency of DSA top-k attention in MQA form over the shared latent."""
    import torch

    from moestack.ops import dsa

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, tokens, heads, d_qk, device="cuda", generator=g).bfloat16().requires_grad_()
    kv = torch.randn(1, tokens, d_qk, device="cuda", generator=g).bfloat16().requires_grad_()
    t = torch.arange(tokens, device="cuda")
    # the first min(t+1, k) keys of each query: a valid causal selection with the real count per query
    slots = torch.arange(top_k, device="cuda")
    idx = torch.where(slots[None] <= t[:, None], (t[:, None] - slots[None]), -1).to(torch.int32)[None]
    do = torch.randn(1, tokens, heads, d_v, device="cuda", generator=g).bfloat16()
    backend = dsa.select_backend("sparse_mqa_attention", q)
    pairs = float(sum(min(i + 1, top_k) for i in range(tokens)))
    flops = 2.0 * pairs * heads * (d_qk + d_v)  # planner/cost/work.py mla_work
    scale = d_qk ** -0.5

    def fwd():
        return dsa.sparse_mqa_attention(q, kv, idx, d_v, scale)[0]

    t_f = _bench(fwd, warmup=2, reps=5)
    t_fb = _bench(lambda: fwd().backward(do), warmup=2, reps=5)
    t_b = max(t_fb - t_f, 1e-9)
    return min(1.0, flops / t_f / peak), min(1.0, 2 * flops / t_b / peak), backend


def measure_indexer(heads: int, dim: int, top_k: int, tokens: int, peak: float, scoring_eff: float) -> float:
    """Scores scanned per second by indexer scoring + top-k, after the scoring FLOPs priced at `scoring_eff`."""
    import torch

    from moestack.ops import dsa

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, tokens, heads, dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, tokens, dim, device="cuda", generator=g).bfloat16()
    w = torch.randn(1, tokens, heads, device="cuda", generator=g).bfloat16()
    t = _bench(lambda: dsa.indexer_topk_from_inputs(q, k, w, top_k), warmup=1, reps=5)
    pairs = tokens * (tokens + 1) / 2
    t_scoring = 2.0 * pairs * heads * dim / (peak * scoring_eff)
    return pairs / max(t - t_scoring, 0.1 * t)


def measure_hbm(bw_bytes_s: float) -> float:
    import torch

    x = torch.empty(2**30, device="cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    t = _bench(lambda: y.copy_(x))
    return min(1.0, 2 * x.numel() / t / bw_bytes_s)


def calibrate_parts(spec, cal: Calibration, plan, mbs: int, seq: int, ep: int) -> dict[str, PartCalibration]:
    """Measure each layer part whole (tune/parts.py) at two token counts and keep what the analytic
    terms miss, as a fixed cost per pass plus a cost per token, and the saved bytes per token."""
    from moestack.config.cluster import load_cluster_spec
    from moestack.memory.report import single_device_plan
    from moestack.planner.cost.context import Ctx
    from moestack.planner.cost.parts import part_cost
    from moestack.planner.cost.work import model_work
    from moestack.tune.parts import local_expert_spec, measure_parts

    if plan is None:
        plan = single_device_plan(spec.name, seq, mbs, cluster="h200-1gpu")
    plan = plan.model_copy(update={"tp": 1, "cp": 1, "etp": 1, "ep": 1, "devices": 1})
    local = local_expert_spec(spec, ep)
    cluster = load_cluster_spec(plan.cluster).with_devices(1)
    # the second point halves the tokens (the sequence while it stays a few chunks long, else the batch)
    small = (mbs, seq // 2) if seq >= 512 else (max(1, mbs // 2), seq)
    points = [(mbs, seq), small] if small != (mbs, seq) else [(mbs, seq)]
    extras: dict[str, list[tuple[float, float, float]]] = {}  # kind -> [(tokens, fwd extra, bwd extra)]
    saved: dict[str, float] = {}
    for b, s in points:
        timings = measure_parts(spec, b, s, ep)
        p = plan.model_copy(update={"micro_batch_size": b, "seq_len": s})
        ctx = Ctx(p, local, cluster, cal, float(b * s))
        seen: set[str] = set()
        # measure_parts times norm + part alone: compare with the analytic part without its Attention-Residual mix
        for layer in model_work(local.model_copy(update={"attn_res_block_size": None}), s).layers:
            for part in layer.parts:
                t = timings.get(part.kind)
                if t is None or part.kind in seen:
                    continue
                seen.add(part.kind)
                pc = part_cost(part, ctx)
                extras.setdefault(part.kind, []).append((t.tokens, t.fwd_s - pc.fwd, t.bwd_s - pc.bwd))
                if (b, s) == points[0]:
                    saved[part.kind] = max(0.0, t.saved_bytes - t.weight_copy_bytes) / t.tokens
    backends = _backend_names()
    out: dict[str, PartCalibration] = {}
    for kind, pts in extras.items():
        (f_fix, f_tok), (b_fix, b_tok) = (_fixed_and_per_token([(n, e[i]) for n, *e in pts]) for i in (0, 1))
        out[kind] = PartCalibration(tokens=int(pts[0][0]), fwd_extra_s_per_token=f_tok, bwd_extra_s_per_token=b_tok,
                                    fwd_fixed_s=f_fix, bwd_fixed_s=b_fix, act_bytes_per_token=saved[kind],
                                    backend=backends.get(kind, ""))
    return out


def calibrate_host(spec, base: HostCalibration, ep: int = 1, device: str = "cuda") -> tuple[HostCalibration, str]:
    """`base` with layer_s measured on this machine (tune/host.py) and its provenance in `source`, and
    one line for tune's output; where the GPU runs FP8, fp8_layer_s too (the FP8 recipe's pass minus the bf16
    one). On CPU, or when the measurement fails, `base` unchanged and a line that says so. ep_moe_s and tp_layer_s
    stay: they need several GPUs."""
    import datetime

    import torch

    from moestack.tune.host import measure_host

    keep = f"keeping the default layer_s {base.layer_s * 1e3:.1f} ms"
    if torch.device(device).type != "cuda":
        return base, f"host floor: not measured on {device} (a CPU time says nothing about a GPU run); {keep}"
    try:
        t = measure_host(spec, ep=ep, device=device)
    except Exception as err:  # noqa: BLE001 - tune's other measurements stand; the default is a valid calibration
        return base, f"host floor: measurement failed ({type(err).__name__}: {err}); {keep}"
    name = torch.cuda.get_device_name(torch.device(device))
    sampled = (f", {t.layers_built} of {t.layers_trained} blocks built (memory)"
               if t.layers_built < t.layers_trained else "")
    bound = (f"; device time leaks in (+{t.growth_2x:.0%} at 2x tokens): an upper bound"
             if t.growth_2x > HOST_BOUND_GROWTH else f"; host-bound (+{t.growth_2x:.0%} at 2x tokens)")
    source = (f"moestack tune {datetime.date.today().isoformat()} {name}: median of {t.reps} fwd+bwd at {t.tokens} "
              f"tokens = {t.wall_s:.4f} s over {t.layers:g} layers{sampled}{bound}")
    update = {"layer_s": t.layer_s, "source": source}
    pace = ("large: the kernels, not the host, set the pace" if t.tail_s > 0.1 * t.wall_s  # a tenth of the pass
            else "small: the host sets the pace")
    line = (f"host floor: {t.layer_s * 1e3:.2f} ms per layer per micro-batch (default {base.layer_s * 1e3:.2f}): "
            f"{t.wall_s * 1e3:.1f} ms fwd+bwd at {t.tokens} tokens over {t.layers:g} layers{sampled}{bound}; the "
            f"device finished {t.tail_s * 1e3:.1f} ms after the host ({pace})")
    from moestack.ops.fp8 import fp8_unavailable_reason

    try:  # the FP8 recipe's extra host time: the same pass on the recipe, minus the bf16 one
        reason = fp8_unavailable_reason(torch.device(device))
        if reason is not None:
            line += f"; FP8 recipe not measured ({reason})"
        else:
            t8 = measure_host(spec, ep=ep, device=device, precision="fp8")
            growth = max(t.growth_2x, t8.growth_2x)
            if growth > HOST_BOUND_GROWTH:  # the difference would be the device's (the FP8 GEMMs are faster)
                line += (f"; FP8 recipe not measured: not host-bound at this width (+{growth:.0%} at 2x tokens), "
                         f"default fp8_layer_s {base.fp8_layer_s * 1e3:.2f} ms kept")
            else:
                update["fp8_layer_s"] = max(0.0, t8.layer_s - t.layer_s)
                update["source"] += f"; fp8 recipe {t8.wall_s:.4f} s"
                line += (f"; FP8 recipe +{update['fp8_layer_s'] * 1e3:.2f} ms per layer (default "
                         f"{base.fp8_layer_s * 1e3:.2f})")
    except Exception as err:  # noqa: BLE001 - the bf16 measurement stands
        line += f"; FP8 recipe not measured ({type(err).__name__}: {err}), default fp8_layer_s kept"
    return base.model_copy(update=update), line


def calibrate_host_modes(spec, eager: HostCalibration, ep: int = 1, device: str = "cuda"
                         ) -> tuple[dict[str, HostCalibration], str]:
    """Calibration.host_modes: the host constants of compiled blocks (TrainSpec.compile blocks, the host profile
    "blocks"), the same pass as calibrate_host with the blocks compiled, and one line for tune's output. layer_s is
    measured; the rest are `eager`'s (the FP8 GEMMs stay eager boundaries between the graphs, ops/opaque.py, and
    ep_moe_s / tp_layer_s need several GPUs). On CPU, or when compiling or measuring fails, {} and a line that says
    so: plans priced on "blocks" are then refused with the fix (planner/host_profile.py)."""
    import datetime

    import torch

    from moestack.config.train_spec import CompileSpec
    from moestack.tune.host import measure_host

    if torch.device(device).type != "cuda":
        return {}, f"compiled host floor: not measured on {device}; plans priced for compiled blocks need it"
    try:
        t = measure_host(spec, ep=ep, device=device, compile=CompileSpec(mode="blocks"))
    except Exception as err:  # noqa: BLE001 - the eager host floor stands; "blocks" stays unmeasured
        return {}, f"compiled host floor: measurement failed ({type(err).__name__}: {err}); host profile blocks unset"
    name = torch.cuda.get_device_name(torch.device(device))
    bound = (f"device time leaks in (+{t.growth_2x:.0%} at 2x tokens): an upper bound"
             if t.growth_2x > HOST_BOUND_GROWTH else f"host-bound (+{t.growth_2x:.0%} at 2x tokens)")
    source = (f"moestack tune {datetime.date.today().isoformat()} {name}, compile blocks: median of {t.reps} fwd+bwd "
              f"at {t.tokens} tokens = {t.wall_s:.4f} s over {t.layers:g} layers, {bound}; ep_moe_s, tp_layer_s, "
              f"fp8_layer_s as the eager host's")
    line = (f"compiled host floor (compile blocks): {t.layer_s * 1e3:.2f} ms per layer per micro-batch (eager "
            f"{eager.layer_s * 1e3:.2f}), {bound}")
    return {"blocks": eager.model_copy(update={"layer_s": t.layer_s, "source": source})}, line


def _fixed_and_per_token(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit extra = fixed + per_token * tokens through the points (two, or one), both terms >= 0."""
    (n1, e1) = points[0]
    if len(points) == 1 or points[1][0] == n1:
        return 0.0, max(0.0, e1) / n1
    (n2, e2) = points[1]
    per = (e1 - e2) / (n1 - n2)
    fixed = e1 - per * n1
    if per < 0:
        return max(0.0, e1), 0.0
    if fixed < 0:
        return 0.0, max(0.0, e1) / n1
    return fixed, per


def _backend_names() -> dict[str, str]:
    """Which backend each op dispatcher picks in this process (recorded next to the part measurements)."""
    names: dict[str, str] = {}
    try:
        from moestack.ops import kda

        names["kda"] = f"kda={kda.resolve_backend()}"
    except Exception as err:  # noqa: BLE001 - only a label
        names["kda"] = f"kda=? ({err})"
    try:
        import torch

        from moestack.ops import dsa

        probe = torch.empty(1, device="cuda", dtype=torch.bfloat16)
        names["mla"] = f"dsa={dsa.select_backend('sparse_mqa_attention', probe)}"
    except Exception as err:  # noqa: BLE001
        names["mla"] = f"dsa=? ({err})"
    try:
        from moestack.ops import moe

        names["moe"] = f"grouped_mm={moe.resolve_backend()}"
    except Exception as err:  # noqa: BLE001
        names["moe"] = f"grouped_mm=? ({err})"
    return names


def run_tune(model: str, plan_path: Path | None, out: Path | None, seq_len: int | None,
             measure_host: bool = False) -> Calibration:
    """Measure and write the calibration; returns it. ConfigError without a GPU."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("tune: no CUDA GPU on this machine: tune measures kernels on the GPU the runs will use; "
                          "run it there (the planner uses the default calibration until then)")
    from moestack.config.cluster import load_cluster_spec
    from moestack.config.plan import load_plan
    from moestack.planner.cost.work import model_work
    from moestack.planner.profile import load_any_model_spec

    spec = load_any_model_spec(model)
    plan = load_plan(plan_path) if plan_path is not None else None
    seq = seq_len if seq_len is not None else (plan.seq_len if plan else min(spec.max_seq_len, 4096))
    if seq < 2:
        raise ConfigError(f"--seq-len: must be >= 2 tokens per sequence (got {seq})")
    tp = plan.tp if plan else 1
    ep = plan.ep if plan else 1
    mbs = plan.micro_batch_size if plan else 1
    tokens = mbs * seq // (plan.cp if plan else 1)
    name = torch.cuda.get_device_name()
    # peaks (efficiency = measured / peak): the plan's cluster preset, else the h200-1gpu preset
    device = load_cluster_spec(plan.cluster if plan else "h200-1gpu").device
    peak_bf16 = device.peak_flops("bf16")
    base = load_calibration()
    # backend choice per hot op first, so every efficiency below is measured with the backend that will run
    from moestack.tune.kernels import tune_ops

    choices = tune_ops(spec, tokens, tp, ep)
    for c in choices:
        timings = ", ".join(f"{b} {ms:.2f} ms" for b, ms in sorted(c.ms.items(), key=lambda kv: kv[1]))
        print(f"{c.op} [{c.key}]: {c.backend} ({timings or 'only the reference passed'})")
    points: list[GemmPoint] = []
    work = model_work(spec, seq)
    seen = set()
    for layer in work.layers:
        for part in layer.parts:
            for g in part.gemms:
                n, k = g.n, g.k
                if g.split == "col":
                    n //= tp
                elif g.split == "row":
                    k //= tp
                if g.expert:
                    assert spec.moe is not None
                    tpe = max(1, tokens // tp * spec.moe.top_k * ep // spec.moe.num_experts)
                    key = ("g", tpe, n, k)
                    if key in seen:
                        continue
                    seen.add(key)
                    eff = measure_grouped(max(1, spec.moe.num_experts // ep), tpe, n, k, peak_bf16)
                    if eff is not None:
                        points.append(GemmPoint(tokens=tpe, n=n, k=k, grouped=True, efficiency=eff))
                else:
                    key = ("d", tokens, n, k)
                    if key in seen or g.fp32:
                        continue
                    seen.add(key)
                    points.append(GemmPoint(tokens=tokens, n=n, k=k, efficiency=measure_gemm(tokens, n, k, peak_bf16)))
    big = measure_gemm(8192, 8192, 8192, peak_bf16)
    d = 8192
    peak_eff = min(1.0, big / (d / (d + base.gemm_dim_half)))
    heads = spec.gqa.num_heads if spec.gqa else (spec.mla.num_heads if spec.mla else 16)
    attn_f, attn_b = measure_sdpa(max(1, heads // tp), seq, 128, peak_bf16)
    fp8 = measure_fp8_factor(peak_bf16, device.peak_flops("fp8")) if "fp8" in device.peak_tflops else None
    hbm = measure_hbm(device.hbm_bandwidth_gb_s * 1e9)
    update: dict = {}
    measured = []
    if spec.kda is not None:
        kf, kb, kda_backend = measure_kda(max(1, spec.kda.value_heads // tp), spec.kda.head_dim,
                                          spec.kda.chunk_size, tokens, peak_bf16)
        update.update(kda_fwd_eff=kf, kda_bwd_eff=kb)
        measured.append(f"KDA ({kda_backend}) fwd {kf * peak_bf16 / 1e12:.1f} / bwd {kb * peak_bf16 / 1e12:.1f} "
                        "TFLOP/s")
    mla = spec.mla
    if mla is not None and mla.indexer is not None:
        d_qk = mla.kv_lora_rank + mla.qk_rope_head_dim
        sf, sb, dsa_backend = measure_sparse_attention(max(1, mla.num_heads // tp), d_qk, mla.kv_lora_rank,
                                                       mla.indexer.top_k, tokens, peak_bf16)
        update.update(sparse_attn_fwd_eff=sf, sparse_attn_bwd_eff=sb, sparse_attn_heads=max(1, mla.num_heads // tp))
        update["topk_elems_per_s"] = measure_indexer(mla.indexer.num_heads, mla.indexer.head_dim, mla.indexer.top_k,
                                                     tokens, peak_bf16, attn_f)
        measured.append(f"sparse attention ({dsa_backend}) fwd {sf * peak_bf16 / 1e12:.1f} / bwd "
                        f"{sb * peak_bf16 / 1e12:.1f} TFLOP/s; indexer top-k {update['topk_elems_per_s']:.3g} scores/s")
    # everything measured so far; the part calibration prices its analytic terms with it, then joins it
    cal = base.model_copy(update={
        **update,
        "source": f"moestack tune on {name} (torch {torch.__version__}), {spec.name} seq {seq} tp {tp} ep {ep}; "
                  f"CPU Adam from {base.device} defaults",
        "device": name,
        "gemm_peak_eff": peak_eff,
        "flash_attn_fwd_eff": attn_f,
        "flash_attn_bwd_eff": attn_b,
        "fp8_gemm_factor": fp8 if fp8 is not None else base.fp8_gemm_factor,
        "hbm_eff": hbm,
        "gemm_points": points,
        "parts": {},
    })
    parts = calibrate_parts(spec, cal, plan, mbs, seq, ep)
    for kind, pc in parts.items():
        measured.append(f"{kind} part: {(pc.fwd_fixed_s + pc.fwd_extra_s_per_token * pc.tokens) * 1e3:+.2f} ms fwd / "
                        f"{(pc.bwd_fixed_s + pc.bwd_extra_s_per_token * pc.tokens) * 1e3:+.2f} ms bwd beyond the "
                        f"analytic terms at {pc.tokens} tokens (fixed {pc.fwd_fixed_s * 1e3:.2f} / "
                        f"{pc.bwd_fixed_s * 1e3:.2f} ms), "
                        f"{pc.act_bytes_per_token / 1024:.1f} KiB saved per token")
    # opt-in (--measure-host): it leaves out the optimizer step and the FSDP / DTensor hooks that the fitted default
    # includes (benchmarks/RESULTS.md, "The measured host floor")
    host, host_line = (calibrate_host(spec, base.host, ep) if measure_host else
                       (base.host, f"host floor: default layer_s {base.host.layer_s * 1e3:.1f} ms (--measure-host "
                                   f"measures it on this machine)"))
    measured.append(host_line)
    host_modes = dict(base.host_modes)
    if measure_host and host is not base.host:  # beside a measured eager floor only: the two are then comparable
        measured_modes, modes_line = calibrate_host_modes(spec, host, ep)
        host_modes.update(measured_modes)
        measured.append(modes_line)
    cal = cal.model_copy(update={"parts": parts, "host": host, "host_modes": host_modes})
    path = out or Path(f"calibration-{name.replace(' ', '_').lower()}.json")
    save_calibration(cal, path)
    fp8_note = "" if fp8 is not None else " (default: not measured here)"
    print(f"8192^3 bf16 GEMM: {big * peak_bf16 / 1e12:.0f} TFLOP/s; SDPA fwd {attn_f * peak_bf16 / 1e12:.0f} / "
          f"bwd {attn_b * peak_bf16 / 1e12:.0f} TFLOP/s; copy {hbm:.0%} of HBM bandwidth; {len(points)} GEMM "
          f"shapes; fp8 GEMM factor {cal.fp8_gemm_factor:.3f}{fp8_note}")
    for line in measured:
        print(line)
    print(f"wrote {path} (use: moestack plan ... --calibration {path})")
    return cal
