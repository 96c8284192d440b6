"""The optimizer step of the K3 EP16 slice on one GPU: torch's fused AdamW plus the weight cache's bf16 recast (the
path before moestack/ops/adamw) against the Triton pass that writes the copies itself, per launch config.

    python benchmarks/adamw.py                       # the slice's 47 parameters (5.2B), fp32 states, bf16 copies
    python benchmarks/adamw.py --scale 0.25          # a quarter of every parameter's rows (less memory)

Both run on the same tensors (p, g, m, v, copies: 18 bytes per parameter, 94 GB at scale 1), randomly filled, with
the step counts on the device as the optimizers keep them; median of --iters CUDA-event timings after --warmup.
GB/s counts the bytes each path must move: fused AdamW 28 per parameter, the recast 6, the pass 30.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from moestack.ops.adamw.triton_adamw import adamw_triton  # noqa: E402

HP = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
CONFIGS = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)]


def slice_shapes() -> list[tuple[int, ...]]:
    from step import _model_spec

    from moestack.model.transformer import build_model

    return [tuple(p.shape) for p in build_model(_model_spec("k3slice"), "meta", seed=0).parameters()]


def timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each parameter's first dimension")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    shapes = [(max(1, int(s[0] * args.scale)), *s[1:]) for s in slice_shapes()]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(shape, scale, dtype=torch.float32):
        return (torch.randn(shape, device="cuda", generator=gen) * scale).to(dtype)

    ps = [rand(s, 0.02) for s in shapes]
    gs = [rand(s, 1e-3) for s in shapes]
    ms = [rand(s, 1e-4) for s in shapes]
    vs = [rand(s, 1e-4).abs() for s in shapes]
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in ps]
    steps = [torch.full((), 10.0, device="cuda") for _ in shapes]
    n = sum(p.numel() for p in ps)
    print(f"{len(ps)} parameters, {n / 1e9:.2f}B elements, {torch.cuda.get_device_name()}, torch {torch.__version__}")

    def torch_fused():
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(ps, gs, ms, vs, [], steps, lr=HP["lr"], beta1=HP["beta1"], beta2=HP["beta2"],
                            weight_decay=HP["weight_decay"], eps=HP["eps"], amsgrad=False, maximize=False)

    def recast():
        for c, p in zip(copies, ps, strict=True):
            c.copy_(p)

    def torch_and_recast():
        torch_fused()
        recast()

    def streaming(block, warps):
        def run():
            torch._foreach_add_(steps, 1)
            for p, g, m, v, c, s in zip(ps, gs, ms, vs, copies, steps, strict=True):
                adamw_triton(p, g, m, v, s, copy=c, block=block, num_warps=warps, **HP)
        return run

    base = timed(torch_and_recast, args.warmup, args.iters)
    rows = [("torch fused AdamW + recast (before)", base, 34), ("torch fused AdamW", timed(torch_fused, args.warmup,
            args.iters), 28), ("recast alone", timed(recast, args.warmup, args.iters), 6)]
    for block, warps in CONFIGS:
        rows.append((f"Triton pass with copies, BLOCK {block} warps {warps}",
                     timed(streaming(block, warps), args.warmup, args.iters), 30))
    print("| path | ms | GB/s | vs before |\n|---|---|---|---|")
    for name, ms_, bytes_per in rows:
        print(f"| {name} | {ms_:.2f} | {n * bytes_per / ms_ / 1e6:,.0f} | {base / ms_:.2f}x |")


if __name__ == "__main__":
    main()
