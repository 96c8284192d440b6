"""FP8 grouped GEMMs (forward / dX, weight gradient) at many rows per expert: per-expert cuBLAS vs Triton vs bf16.

    python benchmarks/fp8_grouped.py [--rows 2340] [--experts 56] [--zipf 1.0]

K3 EP16's four expert GEMMs of the forward and the input gradient (56 experts x 2340 rows: gate-up 3584 -> 6144,
down 3072 -> 3584, and their dX 6144 -> 3584, 3584 -> 3072), random data quantised as moestack/ops/fp8 does
(quantize_dual's 1x128 rows, the weight cache's 128x128 blocks). Rows per expert uniform, or Zipf-skewed with
--zipf. Columns: bf16 torch._grouped_mm; FP8 per-expert cuBLAS (scaled_mm.rows_mm, the default from
kernels.fp8.cublas_min_rows rows per expert; its host read of the offsets is outside the timed call here); FP8
Triton (grouped_gemm.fp8_grouped_mm_quantized, the default below that). Weight gradients: cuBLAS per expert (two
CUDA streams) and the Triton kernel. triton.testing.do_bench medians, TFLOP/s on the GEMM's FLOPs. The Gluon and
TMA FP8 kernels this benchmark also timed were deleted in the kernel refactor (numbers: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse

import torch

SHAPES = (("gate-up fwd", 3584, 6144), ("down fwd", 3072, 3584), ("gate-up dX", 6144, 3584), ("down dX", 3584, 3072))
WGRAD_SHAPES = (("gate-up dW", 3584, 6144), ("down dW", 3072, 3584))  # dW [E, D, F] in fp32, the parameters' dtype


def _counts(E: int, rows: int, zipf: float) -> list[int]:
    if zipf <= 0:
        return [rows] * E
    w = torch.arange(1, E + 1, dtype=torch.float64).pow(-zipf)
    c = (w / w.sum() * rows * E).floor().long()
    c[0] += rows * E - int(c.sum())
    return c.tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2340, help="mean rows per expert (K3 EP16: 2340)")
    ap.add_argument("--experts", type=int, default=56)
    ap.add_argument("--zipf", type=float, default=0.0, help="Zipf exponent of the expert loads (0 = uniform)")
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("| fp8 grouped | needs a CUDA GPU |")
        return
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=25, rep=args.rep)

    E = args.experts
    counts = _counts(E, args.rows, args.zipf)
    N = sum(counts)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to("cuda", torch.int32)
    ends = offs.tolist()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {E} experts, {N} rows "
          f"(max / mean {max(counts) / (N / E):.2f})")
    print("| GEMM | bf16 grouped_mm | FP8 cuBLAS per expert | FP8 Triton |")
    print("|---|---|---|---|")
    for label, K, F in SHAPES:
        _row(label, N, E, K, F, offs, ends, bench)
    print("| weight gradient | - | FP8 cuBLAS per expert (2 streams) | FP8 Triton |")
    for label, D, F in WGRAD_SHAPES:
        _wgrad_row(label, N, E, D, F, offs, ends, bench)


def _row(label, N, E, K, F, offs, ends, bench) -> None:
    """One GEMM shape: every path on the same random operands, one table row."""
    from moestack.ops.fp8 import quant as fq
    from moestack.ops.fp8 import scaled_mm as fsm
    from moestack.ops.fp8.grouped_gemm import fp8_grouped_mm_quantized

    torch.manual_seed(0)
    x = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(E, F, K, device="cuda", dtype=torch.bfloat16) * 0.02).transpose(1, 2)  # K contiguous
    (qw, sw), (_, swT) = fq.quantize_blocks_pair(w)
    qx_em, sx_em, _, _ = fq.quantize_dual(x, offs, expert_major=True, tiles=False)
    qx, sx, _, _ = fq.quantize_dual(x, offs, tiles=False)
    tf = 2.0 * N * K * F / 1e9
    t16 = bench(lambda: torch._grouped_mm(x, w, offs=offs))
    cells = [f"{tf / t16:.0f}"]
    if fsm.available(x.device) and fsm.shapes_ok(K, F):
        t = bench(lambda: fsm.rows_mm(qx_em, sx_em, qw, sw, swT, ends, torch.bfloat16))
        cells.append(f"{tf / t:.0f} ({t16 / t:.2f}x)")
    else:
        cells.append("not available here")
    t = bench(lambda: fp8_grouped_mm_quantized(qx, sx, qw, sw, offs, torch.bfloat16))
    cells.append(f"{tf / t:.0f} ({t16 / t:.2f}x)")
    print(f"| {label} {N} x {K} -> {F} | " + " | ".join(cells) + " |", flush=True)


def _wgrad_row(label, N, E, D, F, offs, ends, bench) -> None:
    """dW [E, D, F] from the token tiles of x [N, D] and dy [N, F]: cuBLAS per expert (the default at many rows),
    the Triton kernel."""
    from moestack.ops.fp8 import quant as fq
    from moestack.ops.fp8 import scaled_mm as fsm
    from moestack.ops.fp8.grouped_gemm import fp8_grouped_wgrad_quantized

    torch.manual_seed(0)
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(N, F, device="cuda", dtype=torch.bfloat16)
    like = torch.empty(E, D, F, device="cuda", dtype=torch.float32)
    tf = 2.0 * N * D * F / 1e9
    cells = []
    if fsm.available(x.device):
        _, _, qxT, sxT = fq.quantize_dual(x, offs, expert_major=True)
        _, _, qdyT, sdyT = fq.quantize_dual(dy, offs, expert_major=True)
        t = bench(lambda: fsm.wgrad(qxT, sxT, qdyT, sdyT, ends, like))
        cells.append(f"{tf / t:.0f}")
    else:
        cells.append("not available here")
    _, _, qxT, sxT = fq.quantize_dual(x, offs)
    _, _, qdyT, sdyT = fq.quantize_dual(dy, offs)
    t = bench(lambda: fp8_grouped_wgrad_quantized(qxT, sxT, qdyT, sdyT, offs, like))
    cells.append(f"{tf / t:.0f}")
    print(f"| {label} {D} x {N} tokens x {F} | - | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
