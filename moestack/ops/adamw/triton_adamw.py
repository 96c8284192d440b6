"""AdamW in one Triton pass per parameter: reads p, g, m, v once, writes p, m, v and the bf16 compute copy.

torch's fused AdamW streams p, g, m, v (28 bytes per fp32 parameter) and the weight cache then recasts every copy
(moestack/memory/compute_weights.py: 4 bytes read, 2 written). Here the copy is written from the registers that
hold the new p: 30 bytes per parameter in one pass. The math is reference.py's; the bias corrections are read from
the parameter's device step count (beta^t as exp2(t log2 beta) in fp32: within a few ulp of torch's pow), the
division and square root are IEEE (div_rn, sqrt_rn) as in torch's kernel. The bf16 rounding is done on the bits
(round to nearest even, NaN kept a NaN), so the copy is the bits of `copy.copy_(p)` under the interpreter too, where
Triton's own fp32 -> bf16 cast truncates. found_inf (the non-finite skip) masks every load and store: a skipped step
moves no bytes.

One launch per parameter (a few hundred per step at most): no pointer tables, and a config that does not depend on
the tensor. BLOCK / NUM_WARPS: benchmarks/adamw.py on the H200 (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _bf16_bits(x):
    """fp32 -> the int16 bits of bf16, round to nearest even; NaN -> the quiet NaN 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, copy_ptr, step_ptr, found_inf_ptr, grad_scale_ptr, n,
                 lr, lr_wd, beta1, beta2, log2_beta1, log2_beta2, eps,
                 HAS_COPY: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    limit = n
    if HAS_INF:
        limit = tl.where(tl.load(found_inf_ptr) != 0, 0, n)
    mask = offs < limit
    step = tl.load(step_ptr).to(tl.float32)
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2_sqrt = tl.sqrt_rn(1.0 - tl.exp2(step * log2_beta2))
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    if HAS_SCALE:
        g = tl.div_rn(g, tl.load(grad_scale_ptr))
    p = tl.load(p_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    p = p - lr_wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
    p = p - tl.div_rn(tl.div_rn(lr, bias1) * m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + offs, _bf16_bits(p), mask=mask)


def adamw_triton(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor, *,
                 lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 copy: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None,
                 found_inf: torch.Tensor | None = None, block: int = BLOCK, num_warps: int = NUM_WARPS) -> None:
    """One update in place (p, m, v fp32 contiguous; g fp32 / bf16 contiguous; copy bf16 contiguous or None; step,
    grad_scale, found_inf one-element device tensors, step counted already)."""
    n = p.numel()
    if n == 0:
        return
    adamw_kernel[(triton.cdiv(n, block),)](
        p, g, m, v, copy.view(torch.int16) if copy is not None else p, step,
        found_inf if found_inf is not None else step, grad_scale if grad_scale is not None else step, n,
        lr, lr * weight_decay, beta1, beta2, math.log2(beta1) if beta1 > 0 else -math.inf,
        math.log2(beta2) if beta2 > 0 else -math.inf, eps,
        HAS_COPY=copy is not None, HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None,
        BLOCK=block, num_warps=num_warps,
    )
