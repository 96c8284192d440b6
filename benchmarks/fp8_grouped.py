"""FP8 grouped GEMM (forward / dX) at many rows per expert: the Gluon kernel vs per-expert cuBLAS vs Triton vs bf16.

    python benchmarks/fp8_grouped.py [--rows 2340] [--experts 56] [--configs all]

K3 EP16's four expert GEMMs of the forward and the input gradient (56 experts x 2340 rows: gate-up 3584 -> 6144,
down 3072 -> 3584, and their dX 6144 -> 3584, 3584 -> 3072), random data quantised as the v3 path does
(quantize_dual's 1x128 rows, the weight cache's 128x128 blocks). Rows per expert uniform, or Zipf-skewed with
--zipf. Columns: bf16 torch._grouped_mm; FP8 per-expert cuBLAS (fp8_scaled_mm.rows_mm, the v3 path; its host read of
the offsets is outside the timed call here); FP8 Triton (fp8_tma, persistent, BT 128); FP8 Gluon (gluon_fp8_gemm)
per config. triton.testing.do_bench medians, TFLOP/s on the GEMM's FLOPs; "same" = bitwise equal to the Triton
kernel's output. --ceiling: the Gluon kernel with the per-slice promotion taken out (gluon_fp8_gemm.feed_ceiling),
two and three consumer warpgroups: what its loads and MMAs alone reach.
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
    ap.add_argument("--configs", default="default", help="'default' or 'all' Gluon configs")
    ap.add_argument("--ceiling", action="store_true", help="add the Gluon kernel's feed ceiling (no promotion) per "
                    "consumer count")
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("| fp8 grouped | needs a CUDA GPU |")
        return
    from triton.testing import do_bench

    from moestack.ops.moe import gluon_fp8_gemm as gg

    def bench(fn):
        return do_bench(fn, warmup=25, rep=args.rep)

    E = args.experts
    counts = _counts(E, args.rows, args.zipf)
    N = sum(counts)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to("cuda", torch.int32)
    ends = offs.tolist()
    configs = gg.CONFIGS if args.configs == "all" else gg.CONFIGS[:1]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {E} experts, {N} rows "
          f"(max / mean {max(counts) / (N / E):.2f})")
    ceilings = [c for c in gg.CONFIGS if not c[1]][:2] if args.ceiling else []  # one per consumer count
    print("| GEMM | bf16 grouped_mm | FP8 cuBLAS per expert | FP8 Triton | "
          + " | ".join(f"FP8 Gluon {c}" for c in configs)
          + "".join(f" | feed ceiling (no promotion) {c[0]} warpgroups" for c in ceilings) + " |")
    print("|---" * (4 + len(configs) + len(ceilings)) + "|")
    for label, K, F in SHAPES:
        _row(label, N, E, K, F, offs, ends, configs, ceilings, bench)
    print("| weight gradient | - | FP8 cuBLAS per expert | same, 2 streams | FP8 Triton |")
    for label, D, F in WGRAD_SHAPES:
        _wgrad_row(label, N, E, D, F, offs, ends, bench)


def _row(label, N, E, K, F, offs, ends, configs, ceilings, bench) -> None:
    """One GEMM shape: every backend on the same random operands, one table row."""
    from moestack.ops.moe import fp8_quant as fq
    from moestack.ops.moe import fp8_scaled_mm as fsm
    from moestack.ops.moe import fp8_tma
    from moestack.ops.moe import gluon_fp8_gemm as gg

    torch.manual_seed(0)
    x = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(E, F, K, device="cuda", dtype=torch.bfloat16) * 0.02).transpose(1, 2)  # K contiguous
    (qw, sw), (_, swT) = fq.quantize_blocks_pair(w)
    qx_em, sx_em, _, _ = fq.quantize_dual(x, offs, expert_major=True, tiles=False)
    qx, sx, _, _ = fq.quantize_dual(x, offs, tiles=False)
    tf = 2.0 * N * K * F / 1e9
    t16 = bench(lambda: torch._grouped_mm(x, w, offs=offs))
    cells = [f"{tf / t16:.0f}"]
    t = bench(lambda: fsm.rows_mm(qx_em, sx_em, qw, sw, swT, ends, torch.bfloat16))
    cells.append(f"{tf / t:.0f} ({t16 / t:.2f}x)")
    y_tri = fp8_tma.grouped_mm(qx, sx, qw, sw, offs, torch.bfloat16)
    t = bench(lambda: fp8_tma.grouped_mm(qx, sx, qw, sw, offs, torch.bfloat16))
    cells.append(f"{tf / t:.0f} ({t16 / t:.2f}x)")
    for c in configs:
        y = gg.grouped_mm(qx_em, sx_em, qw, sw, offs, torch.bfloat16, config=c)
        same = torch.equal(y, y_tri)
        t = bench(lambda c=c: gg.grouped_mm(qx_em, sx_em, qw, sw, offs, torch.bfloat16, config=c))
        cells.append(f"{tf / t:.0f} ({t16 / t:.2f}x{', same' if same else ', DIFFERS'})")
    for c in ceilings:
        t = bench(lambda c=c: gg.feed_ceiling(qx_em, sx_em, qw, sw, offs, torch.bfloat16, config=c))
        cells.append(f"{tf / t:.0f}")
    print(f"| {label} {N} x {K} -> {F} | " + " | ".join(cells) + " |", flush=True)


def _wgrad_row(label, N, E, D, F, offs, ends, bench) -> None:
    """dW [E, D, F] from the token tiles of x [N, D] and dy [N, F]: cuBLAS per expert (the default) on one and on two
    CUDA streams (MOESTACK_FP8_WGRAD_STREAMS), Triton (the sync-free choice, MOESTACK_FP8_TMA_WGRAD=1)."""
    import os
    from unittest import mock

    from moestack.ops.moe import fp8_quant as fq
    from moestack.ops.moe import fp8_scaled_mm as fsm
    from moestack.ops.moe import fp8_tma

    torch.manual_seed(0)
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(N, F, device="cuda", dtype=torch.bfloat16)
    like = torch.empty(E, D, F, device="cuda", dtype=torch.float32)
    _, _, qxT, sxT = fq.quantize_dual(x, offs, expert_major=True)
    _, _, qdyT, sdyT = fq.quantize_dual(dy, offs, expert_major=True)
    tf = 2.0 * N * D * F / 1e9
    cells = []
    ref = None
    for streams in ("1", "2"):
        with mock.patch.dict(os.environ, {fsm.WGRAD_STREAMS_ENV: streams}):
            dw = fsm.wgrad(qxT, sxT, qdyT, sdyT, ends, like)
            same = "" if ref is None else (", same" if torch.equal(dw, ref) else ", DIFFERS")
            ref = dw if ref is None else ref
            t = bench(lambda: fsm.wgrad(qxT, sxT, qdyT, sdyT, ends, like))
        cells.append(f"{tf / t:.0f}{same}")
    tt = bench(lambda: fp8_tma.wgrad(qxT, sxT, qdyT, sdyT, offs, like))
    cells.append(f"{tf / tt:.0f}")
    print(f"| {label} {D} x {N} tokens x {F} | - | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
