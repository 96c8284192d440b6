"""A low-precision gradient into an fp32 one: `accumulate_into(dst, src)` returns dst + src widened (dst None: src
widened), written into dst. The weight cache's hooks (moestack/memory/compute_weights.py) move each micro-batch's
bf16 weight gradient into the fp32 parameter's .grad with it.

On CUDA one Triton pass (reads 2 + 4 bytes, writes 4 per element). torch's mixed-dtype `add_` runs an unvectorised
loop there (K3 slice, accumulation 4, H200: 59 ms per step, plus 19 ms for the first micro-batch's cast, where the
cast and fp32 AccumulateGrad had taken 74 ms; this pass 43 ms; benchmarks/RESULTS.md). Elsewhere, and for tensors
that are not contiguous, the torch ops below are the path and the reference: the widening is exact and the add is
one fp32 rounding, so both give the same bits.
"""

from __future__ import annotations

import importlib.util

import torch

BLOCK = 4096
HAS_TRITON = importlib.util.find_spec("triton") is not None


def accumulate_reference(dst: torch.Tensor | None, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dst is None:
        return src.to(dtype)
    return dst.add_(src)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def accumulate_kernel(dst, src, n, FIRST: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.load(src + offs, mask=mask).to(tl.float32)
        if not FIRST:
            acc += tl.load(dst + offs, mask=mask)
        tl.store(dst + offs, acc, mask=mask)

    def accumulate_triton(dst: torch.Tensor | None, src: torch.Tensor) -> torch.Tensor:
        """The kernel on any device Triton runs on (CPU under TRITON_INTERPRET=1); fp32 dst, contiguous both."""
        out = torch.empty(src.shape, dtype=torch.float32, device=src.device) if dst is None else dst
        n = src.numel()
        if n:
            accumulate_kernel[(triton.cdiv(n, BLOCK),)](out, src, n, FIRST=dst is None, BLOCK=BLOCK, num_warps=8)
        return out


def accumulate_into(dst: torch.Tensor | None, src: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    fused = (HAS_TRITON and src.is_cuda and dtype == torch.float32 and src.is_contiguous()
             and (dst is None or (dst.dtype == dtype and dst.is_contiguous() and dst.shape == src.shape)))
    return accumulate_triton(dst, src) if fused else accumulate_reference(dst, src, dtype)
