"""Batch-scope quantile solver (moestack.ops.moe.quantile.batch_bias) on CUDA: torch reference vs Triton, per
call: GPU time (CUDA events, median), host time (the call's return without a sync, median: what a host-bound step
pays), and launches (kernels the profiler sees on the device, and aten ops dispatched). "triton-staged" is the
Triton solve as a balance group of > 1 ranks runs it (B-bin histograms, 4 launches per step), on one process: the
cost of forming the full histograms, which the fused solve's radix select avoids. Then each Triton variant's GPU
time per kernel (one profiled call).

    python3 benchmarks/tools/quantile_solver_bench.py                 # proxy and K3 shapes, 4 steps, 1000 bins
    python3 benchmarks/tools/quantile_solver_bench.py --shape 32768,896,16 --iters 100
    python3 benchmarks/tools/quantile_solver_bench.py --select-block 4096   # the fused solve's chunk, for a trial

Inputs: sigmoid scores of skewed logits (per-expert offsets), bias N(0, 0.1). It also prints the largest
|triton - reference| of the bias (the mean-centring's rounding; tests/ops/test_moe_quantile_triton.py) and
whether the fused and staged solves agree bit for bit (they must).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moestack.ops.moe import quantile, triton_quantile  # noqa: E402


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _device_kernels(fn) -> dict[str, tuple[int, float]]:
    """The device kernels of one call: {name: (launches, total ms)}."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, tuple[int, float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, ms = kernels.get(e.name, (0, 0.0))
            kernels[e.name] = (n + 1, ms + e.time_range.elapsed_us() / 1e3)
    return kernels


def _time(fn, iters: int) -> tuple[float, float]:
    """(GPU ms, host ms) medians over `iters` calls after a warm-up."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(gpu), statistics.median(host)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", help="T,E,k (repeatable); default the proxy's and K3's")
    p.add_argument("--bins", type=int, default=1000)
    p.add_argument("--steps", type=int, default=4, help="coordinate steps per call (quantile_iterations)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per backend")
    p.add_argument("--select-block", type=int, help="triton_quantile.BLOCK_T_SELECT for this run (a power of 2)")
    args = p.parse_args()
    if args.select_block:
        triton_quantile.BLOCK_T_SELECT = args.select_block
    assert torch.cuda.is_available(), "needs a CUDA device"
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape] if args.shape else \
        [(4096, 128, 16), (8192, 896, 16), (32768, 896, 16)]
    print(f"# {torch.cuda.get_device_name()}, bins {args.bins}, {args.steps} steps per call; medians of "
          f"{args.iters}; fused solve chunk {triton_quantile.BLOCK_T_SELECT} tokens")
    print("| T | E | k | backend | GPU ms | host ms | device kernels | aten ops |")
    print("|---|---|---|---|---|---|---|---|")
    for T, E, k in shapes:
        g = torch.Generator().manual_seed(T + E)
        s = torch.sigmoid(torch.randn(T, E, generator=g) + torch.linspace(-2, 2, E)).cuda()
        b = (torch.randn(E, generator=g) * 0.1).cuda()
        out, per_kernel = {}, {}
        for backend in ("reference", "triton", "triton-staged"):
            def fn(backend=backend):
                if backend == "triton-staged":
                    return triton_quantile.batch_bias_triton(s, b, k, args.bins, args.steps, staged=True)
                return quantile.batch_bias(s, b, k, args.bins, args.steps, backend=backend)

            out[backend] = fn()
            gpu_ms, host_ms = _time(fn, args.iters)
            with _CountOps() as ops:
                fn()
            kernels = _device_kernels(fn)
            if backend != "reference":
                per_kernel[backend] = kernels
            launches = sum(n for n, _ in kernels.values())
            print(f"| {T} | {E} | {k} | {backend} | {gpu_ms:.3f} | {host_ms:.3f} | {launches} | {ops.n} |")
        err = float((out["triton"] - out["reference"]).abs().max())
        same = torch.equal(out["triton"], out["triton-staged"])
        print(f"|   |   |   | max abs diff {err:.3g}; fused == staged bit for bit: {same} | | | | |")
        for backend, kernels in per_kernel.items():
            print(f"#   {backend} kernels per call: " + ", ".join(
                f"{name[:40]} x{n} {ms:.3f} ms" for name, (n, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1])))


if __name__ == "__main__":
    main()
