"""The spec of one AdamW update (decoupled weight decay, bias-corrected moments), in plain torch, per tensor.

The order of operations is that of torch.optim.AdamW's fused CUDA kernel, in the parameter's dtype:

    g     <- g / grad_scale                         (grad_scale: the clip folded in, moestack/train/step_update.py)
    p     <- p - lr * wd * p
    m     <- beta1 m + (1 - beta1) g
    v     <- beta2 v + (1 - beta2) g^2
    p     <- p - (lr / (1 - beta1^t)) m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    copy  <- round_to_nearest_even(p)               (the bf16 compute copy, when one is kept)

t is the step count after this step's increment. A non-zero found_inf leaves p, m, v and the copy untouched.
"""

from __future__ import annotations

import math

import torch


def adamw_reference(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: float, *, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float, copy: torch.Tensor | None = None,
                    grad_scale: float | None = None, found_inf: bool = False) -> None:
    """One update of p, m, v (and copy) in place; `step` counted already (1 at the first update)."""
    if found_inf:
        return
    g = g.to(p.dtype)
    if grad_scale is not None:
        g = g / grad_scale
    p.sub_(lr * weight_decay * p)
    m.mul_(beta1).add_((1 - beta1) * g)
    v.mul_(beta2).add_((1 - beta2) * g * g)
    bias1, bias2_sqrt = 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)
    p.sub_((lr / bias1) * m / (v.sqrt() / bias2_sqrt + eps))
    if copy is not None:
        copy.copy_(p)
