"""Grouped GEMM for MoE experts: Triton (ours, bf16) and FP8 blockwise (ours) vs torch's grouped GEMM, one process.

    python3 benchmarks/grouped_gemm.py                                   # default: all shapes, < 150 s on an H200
    python3 benchmarks/grouped_gemm.py --write-crossover crossover.json  # also write the "auto" crossover table
    python3 benchmarks/grouped_gemm.py --shapes k3_ep16 --tokens 64,2341
    python3 benchmarks/grouped_gemm.py --quick     # K3 EP16 at 32/64/128/586 tok/exp + fp8 quantiser times (< 90 s)
    python3 benchmarks/grouped_gemm.py --small     # issue #7: <= 128 tok/exp, torch vs triton, per-kernel ms
                                                   # and TB/s vs the roofline (< 120 s)

Per expert-FFN shape (E experts, width D, intermediate I; SwiGLU: gate_up D -> 2I, down I -> D) and tokens per
expert (uniform, N = E * tokens rows): each of the two GEMMs timed forward and forward+backward (dX and dW) for
torch (moestack.ops.moe.reference.grouped_mm, i.e. torch's native grouped GEMM), triton and fp8 on the same random
bf16 inputs (weights as the transposed view of [E, F, D], like Experts passes). Times are medians of CUDA-event
timings after a warm-up that also absorbs autotuning. TFLOP/s = 2 N D F (forward), 3x that (forward+backward).
Rows "layer" add the two GEMMs; rows "layer (in sequence)" time them one after the other in one call.
Crossover: for each GEMM shape "DxF", the largest tokens per expert up to which triton's forward+backward beats
torch's at every measured point below it (0: never), written to the JSON (KernelSpec.moe.crossover reads it).

Backends: torch, triton (moestack.ops.moe.triton_grouped_gemm: the swap-AB schedule with TMA-loaded operands,
gg_tma.py, and its weight gradient), fp8 (the FP8 recipe's expert GEMM with cached fp8 weights: the steady state of
several micro-batches per optimizer step, the weights do not change between the timed calls). "err": per backend
the largest relative error of y, dx, dw vs torch's (bf16 ~1e-3 expected; fp8 ~3e-2). (The persistent, swap, tma-p
families and FP8 v1 / v2 measured before the refactor were removed; their numbers stay in benchmarks/RESULTS.md.)

--small times calls queued back to back (the host's launch cost, ~30-80 us per Triton call with descriptors and
autotuner dispatch, is hidden behind the previous call as in a training step; the default times each call
synchronised, which charges it), and adds rows "| part |": each kernel alone (fwd, dX, dW; torch's through
torch._grouped_mm, ours through gg_tma, dW also by the Gluon kernel where it applies) with ms, bytes moved (weights or dW once, plus
the activations), achieved TB/s, and the roofline ms = max(bytes / 4.8 TB/s, FLOPs / 989 TFLOP/s) (H200 peak
bandwidth, dense bf16 peak).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moestack.ops.moe import reference

SHAPES = {  # name: (E, D, I); K3 EP16 first: it is the shape the FP8 and layer targets are set at
    "k3_ep16": (56, 3584, 3072),
    "e56_2048_1024": (56, 2048, 1024),
    "e224_1024_512": (224, 1024, 512),
}
TOKENS = [16, 32, 64, 128, 256, 586, 2341]
BUDGET_S = 140.0


QUICK_TOKENS = [32, 128, 586, 64]  # 64 last: the first three matter most if the budget runs out
QUICK_BUDGET_S = 55.0  # --quick starts no new token count after this (compilation included)
# --small: (shape, tokens per expert) in order of importance (the budget may cut the tail); the smaller shapes
# reuse the K3 binaries (same specialisations), so they cost little compile time
SMALL_PLAN = [("k3_ep16", [32, 128]), ("e56_2048_1024", [32]), ("e224_1024_512", [32]), ("k3_ep16", [16, 64]),
              ("e56_2048_1024", [128]), ("e224_1024_512", [128])]
SMALL_BUDGET_S = 100.0
PEAK_TBS, PEAK_TFS = 4.8, 989.0  # H200: HBM3e bandwidth, dense bf16 tensor-core peak


def backends(fp8: bool = True) -> dict:
    """name -> grouped_mm; fp8=False leaves the FP8 module unimported (--small, --no-fp8)."""
    from moestack.ops.moe import triton_grouped_gemm as tg

    fns = {"torch": reference.grouped_mm, "triton": tg.grouped_mm}
    if fp8:
        from moestack.ops.fp8 import grouped_gemm as f8

        fns["fp8"] = f8.grouped_mm
    return fns


def quant_times(E: int, D: int, F: int, tokens: int) -> str:
    """One '|' row: ms of the fp8 quantisers at this GEMM (x's rows and token tiles in one read, both layouts of w's
    blocks) and of the Triton fp8 forward GEMM alone on the quantised operands."""
    import triton.testing

    from moestack.ops.fp8 import grouped_gemm as f8
    from moestack.ops.fp8 import quant as fq

    x, w, offs, _ = make_gemm(E, D, F, tokens, seed=7)
    x, w = x.detach(), w.detach()
    qx, sx, _, _ = fq.quantize_dual(x, offs, tiles=False)
    (qw, sw), _ = fq.quantize_blocks_pair(w)
    t = [triton.testing.do_bench(fn, warmup=5, rep=30) for fn in
         (lambda: fq.quantize_dual(x, offs), lambda: fq.quantize_blocks_pair(w),
          lambda: f8.fp8_grouped_mm_quantized(qx, sx, qw, sw, offs, x.dtype))]
    return (f"| quant ms | {tokens} | {D}x{F} | x rows + token tiles {t[0]:.3f} | blocks(w) pair {t[1]:.3f} | "
            f"fp8 fwd GEMM alone (Triton) {t[2]:.3f} |")


def part_rows(shape: str, tokens: int, gemm: str, x, w, offs, dy) -> None:
    """'| part |' rows: each kernel of torch's and ours alone, ms, TB/s achieved, roofline."""
    from moestack.ops.moe import gg_tma
    from moestack.ops.moe import triton_grouped_gemm as tg

    x, w, dy = x.detach(), w.detach(), dy.detach()
    N, D = x.shape
    E, _, F = w.shape
    bt = tg.swap_token_tile(N, E)
    wt = w.transpose(1, 2)
    act = 2 * N * (D + F)  # bytes of the two activations (read x, write y / read dy, write dx / read both)
    nbytes = 2 * E * D * F + act  # every kernel: the weights or dW once, plus the activations
    parts = {
        "fwd torch": lambda: reference.grouped_mm(x, w, offs),
        "dX torch": lambda: reference.grouped_mm(dy, wt, offs),
        "dW torch": lambda: reference._NATIVE_GROUPED_MM(x.t(), dy, offs=offs),
        "fwd tma": lambda: gg_tma.grouped_mm_fwd(x, w, offs, bt),
        "dX tma": lambda: gg_tma.grouped_mm_fwd(dy, wt, offs, bt),
        "dW tma": lambda: gg_tma.grouped_mm_wgrad(x, dy, offs, w, bt, gluon=False),
    }
    if gg_tma._gluon_wgrad_ok(dy, x, w.transpose(1, 2)):  # the kernel's (P, Q, out) in w's [E, F, D] layout
        from moestack.ops.moe import gluon_wgrad

        rmax = gluon_wgrad.rmax_for(bt)
        parts["dW gluon"] = partial(_gluon_dw, gluon_wgrad, x, dy, offs, w, rmax)
    flops = 2.0 * N * D * F
    roof = max(2 * E * D * F / (PEAK_TBS * 1e9), flops / (PEAK_TFS * 1e9))
    cells = []
    for name, fn in parts.items():
        try:
            ms = median_ms(fn, target_ms=30.0)
            cells.append(f"{name} {ms:.3f} ms {nbytes / (ms * 1e9):.2f} TB/s ({roof / ms:.0%})")
        except Exception as e:
            cells.append(f"{name} failed {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    for name in [n for n in parts if n.startswith("dW gluon")]:  # vs the chunked kernel
        try:  # (same fp32 accumulation of bf16 products: equal up to the summation order)
            a, b = parts[name]().float(), parts["dW tma"]().float()
            cells.append(f"{name} vs tma rel. diff {float((a - b).norm() / b.norm()):.1e}")
        except Exception as e:
            cells.append(f"{name} check failed {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    print(f"| part | {shape} | {tokens} | {gemm} | roofline {roof:.3f} ms | " + " | ".join(cells) + " |", flush=True)


def _gluon_dw(gluon_wgrad, x, dy, offs, w, rmax: int) -> torch.Tensor:
    """dW by gluon_wgrad alone (every expert here has <= rmax rows), in w's [E, F, D] layout."""
    dw = torch.empty_like(w.transpose(1, 2))  # out[e, f, d] = sum_r dy[r, f] x[r, d]
    gluon_wgrad.wgrad_gluon(dy, x, dw, offs, rmax)
    return dw.transpose(1, 2)


BACK_TO_BACK = False  # --small: time calls queued back to back (host launch cost hidden, as in a training step)


def median_ms(fn, target_ms: float = 60.0) -> float:
    """Median of CUDA-event timings; fn() warmed up twice first (autotuning happens there). Each call alone
    (synchronised: the host's launch cost counts), or with BACK_TO_BACK all calls queued, one sync at the end."""
    fn()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = int(min(50, max(3, target_ms / max(start.elapsed_time(end), 1e-3))))
    if BACK_TO_BACK:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in events:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in events)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def make_gemm(E: int, D: int, F: int, tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    N = E * tokens
    x = torch.randn(N, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(E, F, D, device="cuda", generator=g) / D**0.5).bfloat16().transpose(1, 2).requires_grad_(True)
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * tokens
    dy = torch.randn(N, F, device="cuda", generator=g).bfloat16()
    return x, w, offs, dy


def time_gemm(fn, x, w, offs, dy) -> tuple[float, float]:
    def fwd():
        with torch.no_grad():
            fn(x, w, offs)

    def fwd_bwd():
        torch.autograd.grad(fn(x, w, offs), (x, w), dy)

    return median_ms(fwd), median_ms(fwd_bwd)


def time_layer(fn, cases) -> tuple[float, float]:
    """(fwd ms, fwd+bwd ms) of the gate/up and down GEMMs run one after the other in one timed call, as a layer
    runs them (the "layer" row instead adds the two GEMMs' separately timed medians)."""
    def fwd():
        with torch.no_grad():
            for x, w, offs, _ in cases:
                fn(x, w, offs)

    def fwd_bwd():
        for x, w, offs, dy in cases:
            torch.autograd.grad(fn(x, w, offs), (x, w), dy)

    return median_ms(fwd), median_ms(fwd_bwd)


def outputs(fn, x, w, offs, dy) -> tuple:
    """y, dx, dw of one variant (the err column compares them with torch's)."""
    y = fn(x, w, offs)
    return (y.detach(), *torch.autograd.grad(y, (x, w), dy))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fmt(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def crossover(points: list[tuple[int, float, float]]) -> int:
    """Largest tokens with triton faster than torch at it and every smaller measured point (0: never)."""
    best = 0
    for tokens, t_torch, t_triton in sorted(points):
        if not t_triton < t_torch:
            break
        best = tokens
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens per expert, comma list")
    ap.add_argument("--write-crossover", default=None, help="write the auto selector's JSON table here")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--quick", action="store_true", help=f"k3_ep16 at {QUICK_TOKENS} tok/exp, fp8 quantiser times")
    ap.add_argument("--small", action="store_true", help="issue #7: few rows per expert, per-kernel parts")
    ap.add_argument("--variants", default=None, help="comma list of backends to time (default: all; --small: "
                    "torch,triton)")
    args = ap.parse_args()
    args.tokens_given = any(a.startswith("--tokens") for a in sys.argv[1:])  # --small: that list, not SMALL_PLAN's
    budget_s = BUDGET_S
    if args.quick:
        args.shapes, args.tokens = "k3_ep16", ",".join(map(str, QUICK_TOKENS))
        budget_s = QUICK_BUDGET_S
    if args.small:
        global BACK_TO_BACK
        BACK_TO_BACK = True
        args.variants = args.variants or "torch,triton"
        budget_s = SMALL_BUDGET_S
    if not torch.cuda.is_available():
        print("| needs a CUDA GPU |")
        return 1
    t0 = time.perf_counter()
    wanted = args.variants.split(",") if args.variants else None
    fns = backends(fp8=not args.no_fp8 and (wanted is None or any(n.startswith("fp8") for n in wanted)))
    if wanted:
        unknown = [n for n in wanted if n not in fns]
        if unknown:
            ap.error(f"--variants: unknown {unknown}; choose from {list(fns)} (fp8 ones only without --no-fp8)")
        fns = {n: fns[n] for n in wanted}
    names = list(fns)
    auto_kernel = "triton"  # the backend the crossover compares with torch
    print(f"# grouped GEMM, {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 inputs, timing "
          f"{'calls queued back to back' if BACK_TO_BACK else 'each call synchronised'}")
    head = ["shape", "tok/exp", "gemm"] + [f"{n} {p} TF/s" for p in ("fwd", "f+b") for n in names]
    head += [f"{a}/{b} {p}" for a, b in RATIOS if a in fns for p in ("fwd", "f+b")] + ["err"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    points: dict[str, list[tuple[int, float, float]]] = {}
    plan = SMALL_PLAN if args.small and not args.tokens_given else [(shape, list(map(int, args.tokens.split(","))))
                                          for shape in args.shapes.split(",")]
    for shape, token_list in plan:
        E, D, I = SHAPES[shape]
        for tokens in token_list:
            if time.perf_counter() - t0 > budget_s:
                print(f"| {shape} | {tokens} | skipped: time budget of {budget_s:.0f} s spent |")
                continue
            layer = {n: [0.0, 0.0] for n in names}
            flops_layer = 0.0
            cases = []  # both GEMMs' inputs, for the "layer (in sequence)" row
            for gi, (gemm, Din, Fout) in enumerate((("gate_up", D, 2 * I), ("down", I, D))):
                N = E * tokens
                flops = 2.0 * N * Din * Fout
                flops_layer += flops
                ms = {}
                try:
                    x, w, offs, dy = make_gemm(E, Din, Fout, tokens, seed=tokens + gi)
                except torch.OutOfMemoryError as e:
                    print(f"| {shape} | {tokens} | {gemm} | OOM: {str(e).splitlines()[0]} |")
                    continue
                errs = {}
                ref = outputs(reference.grouped_mm, x, w, offs, dy)
                for n, fn in fns.items():
                    try:
                        errs[n] = max(rel(a, b) for a, b in zip(outputs(fn, x, w, offs, dy), ref))
                        ms[n] = time_gemm(fn, x, w, offs, dy)
                    except Exception as e:  # one failing variant must not stop the table
                        print(f"| {shape} | {tokens} | {gemm} | {n} failed: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''} |")
                        ms[n] = (float("nan"), float("nan"))
                    layer[n][0] += ms[n][0]
                    layer[n][1] += ms[n][1]
                if args.small and shape == "k3_ep16":
                    part_rows(shape, tokens, gemm, x, w, offs, dy)
                cases.append((x, w, offs, dy))
                del ref
                _row(shape, tokens, gemm, names, ms, flops, " ".join(f"{n} {e:.0e}" for n, e in errs.items()
                                                                      if n != "torch"))
                if "torch" in ms and auto_kernel in ms:
                    points.setdefault(f"{Din}x{Fout}", []).append((tokens, ms["torch"][1], ms[auto_kernel][1]))
                if args.quick and "fp8" in fns:
                    try:
                        print(quant_times(E, Din, Fout, tokens), flush=True)
                    except Exception as e:
                        print(f"| quant ms | {tokens} | failed: {type(e).__name__}: {str(e)[:200]} |")
            _row(shape, tokens, "layer", names, {n: tuple(v) for n, v in layer.items()}, flops_layer, "")
            if len(cases) == 2:
                seq = {}
                for n, fn in fns.items():
                    try:
                        seq[n] = time_layer(fn, cases)
                    except Exception as e:  # noqa: BLE001 - one failing variant must not stop the table
                        print(f"| {shape} | {tokens} | layer (in sequence) | {n} failed: {type(e).__name__} |")
                        seq[n] = (float("nan"), float("nan"))
                _row(shape, tokens, "layer (in sequence)", names, seq, flops_layer, "")
            del cases
            torch.cuda.empty_cache()
    table = {k: crossover(v) for k, v in points.items()}
    if table:
        default = int(statistics.median(table.values()))
        print(f"\ncrossover (tokens/expert, triton at or below): default {default}, by shape {table}")
        if args.write_crossover:
            from moestack.ops.moe.gemm_select import CrossoverTable

            CrossoverTable(default, table).save(args.write_crossover)
            print(f"wrote {args.write_crossover} (use: --set kernels.moe.crossover={args.write_crossover})")
    if args.small:
        from moestack.ops.moe import gg_tma

        for kern in (gg_tma.gg_fwd_kernel_tma, gg_tma.gg_wgrad_kernel_tma, gg_tma.gg_wgrad_kernel_large):
            for key, cfg in kern.cache.items():  # what the autotuner picked, per key
                print(f"| tuned | {kern.base_fn.__name__} | {key} | {cfg} |")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


RATIOS = [("triton", "torch"), ("fp8", "bf16")]  # "bf16": the best of torch / triton


def _row(shape, tokens, gemm, names, ms, flops, err) -> None:
    tf = {n: (flops / (ms[n][0] * 1e9), 3 * flops / (ms[n][1] * 1e9)) for n in names if n in ms}
    cells = [shape, str(tokens), gemm]
    cells += [fmt(tf[n][p]) if n in tf else "-" for p in (0, 1) for n in names]
    for a, b in RATIOS:
        if a not in names:
            continue
        for p in (0, 1):
            if b == "bf16":
                den = min((ms[n][p] for n in ("torch", "triton") if n in ms), default=float("nan"))
            else:
                den = ms[b][p] if b in ms else float("nan")
            cells.append(f"{den / ms[a][p]:.2f}x" if a in ms else "-")
    cells.append(err)
    print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
