"""Where the FP8 MoE layer's time goes, on one GPU: cuBLAS blockwise FP8 per GEMM shape, and a kernel profile.

    python benchmarks/fp8_breakdown.py            # both parts
    python benchmarks/fp8_breakdown.py gemms      # FP8 vs bf16 per GEMM shape only
    python benchmarks/fp8_breakdown.py profile    # the K3 EP16 layer's kernels, bf16 vs FP8 (+ projections)

gemms: torch._scaled_mm with DeepSeek-V3's blockwise scales (1x128 activations x 128x128 weights; 1x128 x 1x128 for
the weight gradients) and with rowwise scales, against bf16 mm, at K3 EP16's per-expert shapes (2340 rows per
expert), the latent projections, all rows as one GEMM, and the 56-expert grouped GEMMs (torch._grouped_mm vs
torch._scaled_grouped_mm rowwise). Random data, triton.testing.do_bench medians, TFLOP/s.
profile [--variants a,b]: torch.profiler over 3 fwd+bwd iterations of benchmarks/moe.py's K3 EP16 layer per variant
(default bf16, FP8 + projections); kernel time per iteration, the largest
kernels first, and the wall time per iteration. Gradients accumulate between the profiled iterations (no zeroing), so the
bf16 "add" kernels there are the accumulation, which the timed benchmark (grad_to_none) does not run.
"""

from __future__ import annotations

import os
import sys
import time

import torch

FP8 = torch.float8_e4m3fn


def _rand_fp8(rows: int, cols: int) -> torch.Tensor:
    return (torch.randn(rows, cols, device="cuda") * 2).to(FP8)


def _scales(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, device="cuda") + 0.5


def _try(fn):
    from triton.testing import do_bench

    try:
        return do_bench(fn, warmup=25, rep=100)
    except RuntimeError as e:
        print(f"  ({str(e).splitlines()[0][:160]})")
        return float("nan")


def mm_row(M: int, K: int, N: int, label: str) -> None:
    """y [M, N] = a [M, K] b [K, N]: bf16, FP8 1x128 x 128x128 (torch's layouts: a row-major, b column-major,
    outer-dim-major 1x128 scales, K-block-major 128x128 scales), FP8 rowwise."""
    a, b = _rand_fp8(M, K), _rand_fp8(N, K).t()
    a16 = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
    sa, sb = _scales(K // 128, M).t(), _scales(N // 128, K // 128).t()
    ra, rb = _scales(M, 1), _scales(1, N)  # made here: scales created inside the timed call would be timed too
    t16 = _try(lambda: a16 @ b16)
    t8 = _try(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16))
    tr = _try(lambda: torch._scaled_mm(a, b, ra, rb, out_dtype=torch.bfloat16))
    tf = 2.0 * M * K * N / 1e9
    print(f"| {label} | {M} x {K} -> {N} | {tf / t16:.0f} | {tf / t8:.0f} ({t16 / t8:.2f}x) | "
          f"{tf / tr:.0f} ({t16 / tr:.2f}x) |", flush=True)


def wgrad_row(D: int, P: int, F: int, label: str) -> None:
    """dw [D, F] = x^T [D, P] dy [P, F] with 1x128 scales along the P tokens for both operands."""
    a, b = _rand_fp8(D, P), _rand_fp8(F, P).t()
    a16 = torch.randn(D, P, device="cuda", dtype=torch.bfloat16)
    b16 = torch.randn(F, P, device="cuda", dtype=torch.bfloat16).t()
    sa, sb = _scales(P // 128, D).t(), _scales(P // 128, F)
    t16 = _try(lambda: a16 @ b16)
    t8 = _try(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16))
    tf = 2.0 * D * P * F / 1e9
    print(f"| {label} | {D} x {P} x {F} | {tf / t16:.0f} | {tf / t8:.0f} ({t16 / t8:.2f}x) | - |", flush=True)


def grouped_row(E: int, m: int, K: int, N: int, label: str) -> None:
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * m
    a16 = torch.randn(E * m, K, device="cuda", dtype=torch.bfloat16)
    w16 = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    a, w = _rand_fp8(E * m, K), (torch.randn(E, N, K, device="cuda") * 2).to(FP8).transpose(1, 2)
    sa, sw = _scales(E * m), _scales(E, N)
    t16 = _try(lambda: torch._grouped_mm(a16, w16, offs=offs))
    tr = _try(lambda: torch._scaled_grouped_mm(a, w, sa, sw, offs=offs, out_dtype=torch.bfloat16))
    tf = 2.0 * E * m * K * N / 1e9
    print(f"| {label} | {E} x {m} rows, {K} -> {N} | {tf / t16:.0f} | - | {tf / tr:.0f} ({t16 / tr:.2f}x) |",
          flush=True)


def gemms() -> None:
    print(f"| GEMM ({torch.cuda.get_device_name()}, torch {torch.__version__}) | shape | bf16 TFLOP/s | "
          f"FP8 blockwise TFLOP/s | FP8 rowwise TFLOP/s |")
    print("|---|---|---|---|---|")
    mm_row(2340, 3584, 6144, "expert gate-up fwd")
    mm_row(2340, 3072, 3584, "expert down fwd")
    mm_row(2340, 6144, 3584, "expert gate-up dX")
    mm_row(2340, 3584, 3072, "expert down dX")
    wgrad_row(3584, 2432, 6144, "expert gate-up dW")
    wgrad_row(3072, 2432, 3584, "expert down dW")
    mm_row(8192, 7168, 3584, "latent down-projection fwd")
    mm_row(8192, 3584, 7168, "latent up-projection fwd")
    mm_row(131072, 3584, 6144, "all rows as one gate-up GEMM")
    grouped_row(56, 2340, 3584, 6144, "grouped gate-up fwd")
    grouped_row(56, 2340, 3072, 3584, "grouped down fwd")


PROFILE_VARIANTS = ("bf16", "fp8-proj")


def profile(iterations: int = 3, top: int = 14, variants: tuple[str, ...] = PROFILE_VARIANTS) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import moe as bench_moe

    from moestack.ops.fp8 import linear as fp8_linear
    from moestack.ops.fp8 import weight_cache as wc

    shape = next(s for s in bench_moe.SHAPES if s[0] == "k3-ep16")
    _, hidden, latent, inter, e_loc, e_rt, K, T, zipf, G, TG = shape
    torch.manual_seed(0)
    layer = bench_moe.BenchLayer(hidden, latent, inter, e_loc, e_rt, K, zipf, G, TG, "torch", torch.bfloat16)
    x = torch.randn(1, T, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    gy = torch.randn_like(x)
    for variant in variants:
        make, proj = bench_moe.FP8_VARIANTS[variant]
        layer.moe.experts.gemm = make()
        if proj:
            fp8_linear.convert_to_fp8_linear(layer.moe, ["down_proj", "up_proj"])
        wc.clear()

        def step():
            layer.forward(x, "triton").backward(gy)

        step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iterations):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1000 / iterations
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iterations):
                step()
            torch.cuda.synchronize()
        fp8_linear.revert_fp8_linear(layer.moe)
        rows = sorted(((e.self_device_time_total / iterations / 1000, e.count // iterations, e.key[:100])
                       for e in prof.key_averages() if e.self_device_time_total > 0), reverse=True)
        print(f"\n{variant}: kernel time per fwd+bwd {sum(r[0] for r in rows):.2f} ms, wall time {wall_ms:.2f} ms")
        for ms, count, name in rows[:top]:
            print(f"  {ms:7.3f} ms  x{count:<4d} {name}")


def main() -> None:
    if not torch.cuda.is_available():
        print("| fp8 breakdown | needs a CUDA GPU |")
        return
    args = sys.argv[1:]
    variants = PROFILE_VARIANTS
    if "--variants" in args:  # profile's variants: names of benchmarks/moe.py's FP8_VARIANTS, comma list
        i = args.index("--variants")
        if i + 1 >= len(args):
            sys.exit("fp8_breakdown.py: --variants needs a comma list, e.g. bf16,fp8-proj")
        variants = tuple(args[i + 1].split(","))
        del args[i:i + 2]
    parts = args or ["gemms", "profile"]
    unknown = [p for p in parts if p not in ("gemms", "profile")]
    if unknown:
        sys.exit(f"fp8_breakdown.py: unknown part(s) {unknown}; use gemms and / or profile [--variants a,b]")
    if "gemms" in parts:
        gemms()
    if "profile" in parts:
        profile(variants=variants)


if __name__ == "__main__":
    main()
