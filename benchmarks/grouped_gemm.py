"""Grouped GEMM for MoE experts: Triton (ours, bf16) and FP8 blockwise (ours) vs torch's grouped GEMM, one process.

    python3 benchmarks/grouped_gemm.py                                   # default: all shapes, < 150 s on an H200
    python3 benchmarks/grouped_gemm.py --write-crossover crossover.json  # also write the "auto" crossover table
    python3 benchmarks/grouped_gemm.py --shapes k3_ep16 --tokens 64,2341

Per expert-FFN shape (E experts, width D, intermediate I; SwiGLU: gate_up D -> 2I, down I -> D) and tokens per
expert (uniform, N = E * tokens rows): each of the two GEMMs timed forward and forward+backward (dX and dW) for
torch (moestack.ops.moe.reference.grouped_mm, i.e. torch's native grouped GEMM), triton and fp8 on the same random
bf16 inputs (weights as the transposed view of [E, F, D], like Experts passes). Times are medians of CUDA-event
timings after a warm-up that also absorbs autotuning. TFLOP/s = 2 N D F (forward), 3x that (forward+backward).
Rows "layer" add the two GEMMs. Crossover: for each GEMM shape "DxF", the largest tokens per expert up to which
triton's forward+backward beats torch's at every measured point below it (0: never).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
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


def backends() -> dict:
    from moestack.ops.moe import fp8_grouped_gemm, triton_grouped_gemm

    return {"torch": reference.grouped_mm, "triton": triton_grouped_gemm.grouped_mm, "fp8": fp8_grouped_gemm.grouped_mm}


def median_ms(fn, target_ms: float = 60.0) -> float:
    """Median of CUDA-event timings; fn() warmed up twice first (autotuning happens there)."""
    fn()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = int(min(50, max(3, target_ms / max(start.elapsed_time(end), 1e-3))))
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
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("| needs a CUDA GPU |")
        return 1
    t0 = time.perf_counter()
    fns = backends()
    if args.no_fp8:
        fns.pop("fp8")
    names = list(fns)
    print(f"# grouped GEMM, {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 inputs")
    head = ["shape", "tok/exp", "gemm"] + [f"{n} {p} TF/s" for p in ("fwd", "f+b") for n in names]
    head += ["triton/torch fwd", "triton/torch f+b"] + (["fp8/best-bf16 fwd", "fp8/best-bf16 f+b"] if "fp8" in fns else [])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    points: dict[str, list[tuple[int, float, float]]] = {}
    for shape in args.shapes.split(","):
        E, D, I = SHAPES[shape]
        for tokens in map(int, args.tokens.split(",")):
            if time.perf_counter() - t0 > BUDGET_S:
                print(f"| {shape} | {tokens} | skipped: time budget of {BUDGET_S:.0f} s spent |")
                continue
            layer = {n: [0.0, 0.0] for n in names}
            flops_layer = 0.0
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
                for n, fn in fns.items():
                    try:
                        ms[n] = time_gemm(fn, x, w, offs, dy)
                    except Exception as e:  # one failing variant must not stop the table
                        print(f"| {shape} | {tokens} | {gemm} | {n} failed: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''} |")
                        ms[n] = (float("nan"), float("nan"))
                    layer[n][0] += ms[n][0]
                    layer[n][1] += ms[n][1]
                del x, w, dy
                _row(shape, tokens, gemm, names, ms, flops)
                if "torch" in ms and "triton" in ms:
                    points.setdefault(f"{Din}x{Fout}", []).append((tokens, ms["torch"][1], ms["triton"][1]))
            _row(shape, tokens, "layer", names, {n: tuple(v) for n, v in layer.items()}, flops_layer)
            torch.cuda.empty_cache()
    table = {k: crossover(v) for k, v in points.items()}
    if table:
        default = int(statistics.median(table.values()))
        print(f"\ncrossover (tokens/expert, triton at or below): default {default}, by shape {table}")
        if args.write_crossover:
            from moestack.ops.moe.gemm_select import CrossoverTable

            CrossoverTable(default, table).save(args.write_crossover)
            print(f"wrote {args.write_crossover} (use: MOESTACK_MOE_CROSSOVER={args.write_crossover})")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


def _row(shape, tokens, gemm, names, ms, flops) -> None:
    tf = {n: (flops / (ms[n][0] * 1e9), 3 * flops / (ms[n][1] * 1e9)) for n in names if n in ms}
    cells = [shape, str(tokens), gemm]
    cells += [fmt(tf[n][p]) if n in tf else "-" for p in (0, 1) for n in names]
    if "torch" in ms and "triton" in ms:
        cells += [f"{ms['torch'][p] / ms['triton'][p]:.2f}x" for p in (0, 1)]
    if "fp8" in ms:
        best = [min(ms[n][p] for n in ("torch", "triton") if n in ms) for p in (0, 1)]
        cells += [f"{best[p] / ms['fp8'][p]:.2f}x" for p in (0, 1)]
    print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
