"""DSA forward and indexer top-k variants vs the current defaults, one process, one H200 (< 200 s).

    python3 benchmarks/dsa_fwd_indexer.py            # all rows below
    python3 benchmarks/dsa_fwd_indexer.py --no-131k  # T = 32768 only
    python3 benchmarks/dsa_fwd_indexer.py --only-131k  # T = 131072 only: indexer vs attention fwd and fwd+bwd

Rows ('|'-prefixed markdown), in this order (the time cap cuts the last ones first):
* forward, T = 32768, H = 64, top-2048, d_qk 576 / d_v 512, bf16: the Triton kernel ("default") at its best run-4
  config (H64 K64 V512 8 warps 2 stages, forced: no autotuning of the other six) and "auto" (what the op runs: the
  Gluon kernel on sm_90); TFLOP/s on the selected keys (2 H nnz (576 + 512)); o / lse rel. difference vs default.
* indexer + top-k (32 heads x 128, K3.1 Pro; random bf16 inputs) at T = 32768: "chunked" (score blocks of rows
  in HBM + torch.topk; the CPU default), "fused" (the GPU default: sampled threshold + fused scoring with candidate
  compaction + exact top-k of <= 4096 candidates by a bisection select kernel), "fused_torchsel" (fused with
  torch.topk for the last step). Columns: ms, scoring TFLOP/s (T^2/2 x Hi x Di x 2, the causal half), fraction of
  selected keys shared with "chunked", rows recomputed exactly (threshold missed), indexer / attention forward time.
* T = 131072: the fused indexer, the forward the op runs ("auto") on its selection, and the indexer /
  attention-forward ratio (the issue asks <= 1/3 at T = 131072). (The e4m3 scoring variant was removed; its numbers
  stay in benchmarks/RESULTS.md.)
Every variant runs under a guard: an error or the time cap prints a row and the run goes on.
"""

from __future__ import annotations

import argparse
import time

import torch
from dsa import row, timed  # benchmarks/dsa.py: CUDA-event median timing, markdown rows

V_DIM, D_LAT, TOP_K, HI, DI = 512, 576, 2048, 32, 128
SCALE = 192**-0.5
BUDGET_S = 95.0  # later variants print "skipped: time cap" (the GPU slot is 200 s with the tests)
T0 = time.time()


def guarded(label: str, fn):
    if time.time() - T0 > BUDGET_S:
        row(label, "skipped: time cap", "", "", "", "")
        return None
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one failing variant must not end the run
        row(label, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160]}", "", "", "", "")
        torch.cuda.empty_cache()
        return None


def cfg_str(cfg) -> str:
    short = {"BLOCK_H": "H", "BLOCK_K": "K", "BLOCK_V": "V", "BLOCK_T": "T", "BLOCK_S": "S"}
    return " ".join(f"{short.get(k, k)}{v}" for k, v in cfg.kwargs.items()) + f" w{cfg.num_warps} s{cfg.num_stages}"


def restrict(kernel, keep) -> None:
    """Autotune only the configs for which keep(cfg) holds (fewer compiles in the time budget)."""
    if not hasattr(kernel, "all_configs"):
        kernel.all_configs = list(kernel.configs)
    kept = [c for c in kernel.all_configs if keep(c)]
    kernel.configs = kept or kernel.all_configs[:1]
    kernel.cache = {}


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    fin = torch.isfinite(a) & torch.isfinite(b)
    return float((a[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-30))


def indexer_inputs(T: int):
    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(1, T, HI, DI, generator=g, device="cuda").bfloat16()
    k = torch.randn(1, T, DI, generator=g, device="cuda").bfloat16()
    w = (torch.randn(1, T, HI, generator=g, device="cuda") * (HI * DI) ** -0.5).bfloat16()
    return q, k, w


def overlap(got: torch.Tensor, want: torch.Tensor) -> float:
    """Fraction of got's selected keys that want also selects (per row), over all valid slots."""
    g, wt = got[0].long(), want[0].long()
    T = g.shape[0]
    hits, total = 0, 0
    for r0 in range(0, T, 8192):  # [rows, T + 1] bool per block
        gb, wb = g[r0 : r0 + 8192], wt[r0 : r0 + 8192]
        chosen = torch.zeros(gb.shape[0], T + 1, dtype=torch.bool, device="cuda")
        chosen.scatter_(1, wb % (T + 1), True)
        m = gb >= 0
        hits += int(chosen.gather(1, gb % (T + 1))[m].sum())
        total += int(m.sum())
    return hits / max(total, 1)


def attention_inputs(T: int, H: int):
    g = torch.Generator(device="cuda").manual_seed(H)
    q = torch.randn(1, T, H, D_LAT, generator=g, device="cuda").bfloat16()
    kv = torch.randn(1, T, D_LAT, generator=g, device="cuda").bfloat16()
    return q, kv


def bench_forward(T: int, H: int, idx: torch.Tensor, variants=("default", "auto")) -> dict:
    """Rows for the default forward and the given variants; returns {variant: ms}."""
    from moestack.ops.dsa import triton_attn_fwd as F

    q, kv = attention_inputs(T, H)
    nnz = float((idx >= 0).sum())
    flops = 2 * H * nnz * (D_LAT + V_DIM)
    reps = 5 if T <= 32768 else 3
    res, outs = {}, {}
    for variant in variants:

        def run(variant=variant):
            fn = lambda: F.sparse_mqa_fwd(q, kv, idx, V_DIM, SCALE, variant=variant)
            ms = timed(fn, reps)
            outs[variant] = fn()
            kern = F._sparse_mqa_fwd_kernel
            gluon = variant in ("gluon", "auto")  # no autotuner (gluon_attn_fwd.DEFAULT_CONFIG)
            diff = ""
            if variant != "default" and "default" in outs:
                diff = f"vs default: o {rel(outs[variant][0], outs['default'][0]):.1e}, " \
                       f"lse {rel(outs[variant][1], outs['default'][1]):.1e}"  # fmt: skip
            row(f"T={T} H={H}", f"sparse fwd {variant}", f"{ms:.2f}", f"{flops / ms / 1e9:.1f}",
                "gluon" if gluon else f"cfg {cfg_str(kern.best_config)}", diff)  # fmt: skip
            res[variant] = ms

        guarded(f"T={T} H={H} fwd {variant}", run)
    outs.clear()
    return res


def bench_backward(T: int, H: int, idx: torch.Tensor) -> float:
    """The sparse attention backward alone (default dKV mode, on one forward's o / lse): a row; returns ms."""
    from moestack.ops.dsa import triton_attn_bwd as B
    from moestack.ops.dsa import triton_attn_fwd as F
    from moestack.ops.dsa.triton_op import dkv_mode_default

    q, kv = attention_inputs(T, H)
    o, lse = F.sparse_mqa_fwd(q, kv, idx, V_DIM, SCALE)
    do = torch.randn_like(o)
    mode = dkv_mode_default()  # what the op runs (sparse_mqa_attention_triton)
    ms = timed(lambda: B.sparse_mqa_bwd(q, kv, idx, o, lse, do, None, SCALE, mode), reps=2)
    flops = 2 * 2 * H * float((idx >= 0).sum()) * (D_LAT + V_DIM)
    row(f"T={T} H={H}", f"sparse bwd ({mode})", f"{ms:.2f}", f"{flops / ms / 1e9:.1f}", "", "")
    return ms


def bench_indexer(T: int, variants: tuple[str, ...], fwd_ms: dict, ref_name: str, times: dict) -> dict:
    """Rows per indexer variant (ms into times); returns {variant: idx} (for the selection at this T)."""
    from moestack.ops.dsa.triton_indexer import indexer_topk_triton
    from moestack.ops.dsa.triton_indexer_fused import indexer_topk_fused

    q, k, w = indexer_inputs(T)
    flops = T * T / 2 * HI * DI * 2
    sel = {}
    attn = min(fwd_ms.values()) if fwd_ms else None
    for variant in variants:

        def run(variant=variant):
            stats = {}
            if variant == "chunked":
                fn = lambda: indexer_topk_triton(q, k, w, TOP_K, mode="chunked")
            else:
                fn = lambda: indexer_topk_fused(q, k, w, TOP_K, stats=stats,
                                                select="torch" if variant == "fused_torchsel" else "triton")  # fmt: skip
            ms = timed(fn, reps=3 if T <= 32768 else 2)
            sel[variant] = fn()
            agree = ""
            if variant != ref_name and ref_name in sel:
                agree = f"shared with {ref_name} {overlap(sel[variant], sel[ref_name]):.4f}"
            fb = f"fallback rows {int(stats['fallback_rows']) if 'fallback_rows' in stats else '-'}"
            ratio = f"idx/attn-fwd {ms / attn:.2f}" if attn else ""
            times[variant] = ms
            row(f"T={T}", f"indexer+topk {variant}", f"{ms:.2f}", f"{flops / ms / 1e9:.1f}", f"{agree} {fb}", ratio)

        guarded(f"T={T} indexer {variant}", run)
    return sel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-131k", action="store_true", help="T = 32768 only")
    ap.add_argument("--chunked-131k", action="store_true", help="also time the default chunked indexer at 131072")
    ap.add_argument("--only-131k", action="store_true",
                    help="T = 131072 only: fused indexer, default forward and backward, the ratios (~60 s)")
    ap.add_argument("--budget-s", type=float, default=None, help="time cap (later variants are skipped; default 95)")
    args = ap.parse_args()
    global BUDGET_S
    BUDGET_S = args.budget_s or BUDGET_S
    import triton

    from moestack.ops.dsa import triton_attn_fwd as F
    from moestack.ops.dsa import triton_indexer_fused as X

    # compile budget: the default forward at its run-4 best config only; fused indexer scoring: two tiles
    restrict(F._sparse_mqa_fwd_kernel, lambda c: (c.kwargs["BLOCK_H"], c.kwargs["BLOCK_K"], c.kwargs["BLOCK_V"],
                                                  c.num_stages) == (64, 64, 512, 2))  # fmt: skip
    restrict(X.indexer_select_kernel, lambda c: (c.kwargs["BLOCK_T"], c.kwargs["BLOCK_S"]) in ((64, 256), (128, 128)))

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    row("shape", "variant", "ms", "TFLOP/s", "detail", "vs")
    row("---", "---", "---", "---", "---", "---")
    # selection for the attention rows: the fused indexer at each T (same inputs as the indexer rows)
    sel32 = None
    if not args.only_131k:
        sel32 = guarded("T=32768 selection", lambda: X.indexer_topk_fused(*indexer_inputs(32768), TOP_K))
        fwd32 = bench_forward(32768, 64, sel32) if sel32 is not None else {}
        bench_indexer(32768, ("chunked", "fused", "fused_torchsel"), fwd32, "chunked", {})
    if not args.no_131k:
        variants = ("fused",) + (("chunked",) if args.chunked_131k else ())
        times: dict = {}
        sel = bench_indexer(131072, variants, {}, "fused", times)
        if "fused" in sel:
            idx = sel.pop("fused")
            sel.clear()
            torch.cuda.empty_cache()
            fwd131 = bench_forward(131072, 64, idx, variants=("auto",))  # what the op runs
            bwd131 = guarded("T=131072 H=64 bwd", lambda: bench_backward(131072, 64, idx))
            del idx
            if fwd131:
                attn = min(fwd131.values())
                ratios = ", ".join(f"{v} {ms / attn:.2f}" for v, ms in times.items())
                row("T=131072", "indexer / attention fwd (best)", f"{attn:.2f}", "", ratios, "required <= 0.33")
                if bwd131:  # a training step runs the attention's forward and backward once per indexer call
                    ratios = ", ".join(f"{v} {ms / (attn + bwd131):.2f}" for v, ms in times.items())
                    row("T=131072", "indexer / attention fwd+bwd", f"{attn + bwd131:.2f}", "", ratios,
                        "required <= 0.33")
    print(
        f"total {time.time() - T0:.0f} s; required: fwd >= 300 TFLOP/s at T=32768 H=64; "
        "indexer+topk <= 1/3 of sparse attention at T=131072"
    )


if __name__ == "__main__":
    main()
