"""Host time vs GPU time of one grouped-GEMM forward+backward (torch vs the tma kernels), at few rows per expert.

    python benchmarks/gg_host.py                # K3 EP16 gate/up and down GEMMs at 64 rows per expert
    python benchmarks/gg_host.py --rows 32,128

Each call is queued behind a ~30 ms torch.cuda._sleep so the host never waits on the GPU: the host time is what it
costs to enqueue the call (Python, autograd, descriptors, kernel launches), the GPU time (CUDA events around the
call) is the kernels' alone. Medians of 20 / 10. When the host time exceeds the GPU time, a benchmark that does not
hide the host (e.g. one GEMM at a time) measures the host.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

SLEEP_CYCLES = 50_000_000  # ~30 ms at H200 clocks: longer than any host call measured here


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def host_and_gpu_ms(step) -> tuple[float, float]:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    host = []
    for _ in range(20):
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        step()
        host.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(10):
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return _median(host), _median(gpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="64", help="rows per expert, comma list")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("| grouped GEMM host time | needs a CUDA GPU |")
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import grouped_gemm as bench_gg

    from moestack.ops.moe import reference
    from moestack.ops.moe import triton_grouped_gemm as tg

    E, D, inter = bench_gg.SHAPES["k3_ep16"]
    fns = {"torch": reference.grouped_mm, "tma": tg.grouped_mm}
    print(f"| K3 EP16 ({torch.cuda.get_device_name()}) | rows / expert | backend | host ms to enqueue fwd+bwd | "
          f"GPU ms |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        for gemm, (din, dout) in (("down", (inter, D)), ("gate/up", (D, 2 * inter))):
            x, w, offs, dy = bench_gg.make_gemm(E, din, dout, rows, 0)
            for name, fn in fns.items():
                host, gpu = host_and_gpu_ms(
                    lambda fn=fn, x=x, w=w, offs=offs, dy=dy: torch.autograd.grad(fn(x, w, offs), (x, w), dy))
                print(f"| {gemm} | {rows} | {name} | {host:.2f} | {gpu:.2f} |", flush=True)
            del x, w, dy
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
