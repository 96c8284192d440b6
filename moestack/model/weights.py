"""The weight a forward multiplies by: a module's compute copy of a parameter when one is kept, else the parameter.

moestack.memory.compute_weights keeps bf16 copies of the Linear and expert weights, recast in place once per
optimizer step, in `module._compute_weights` (name -> tensor); a forward reads the copy through `CopyOf`, whose
backward is the cast's (the gradient cast back to the parameter's dtype), so the copy stays one tensor at one
address for the whole run: CUDA graphs record it as a static input and replay across steps. Without copies (fp32
runs, FSDP2, FP8 layers) a forward reads the parameter itself and autocast (or FSDP2) casts it as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CopyOf(torch.autograd.Function):
    """`copy` (param cast to copy's dtype, kept up to date by its owner) in the forward, differentiable to `param`:
    the backward of `param.to(copy.dtype)`."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.param_dtype = param.dtype
        return copy

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.param_dtype), None


def compute_weight(module: nn.Module, name: str = "weight") -> torch.Tensor:
    param = getattr(module, name)
    cached = module.__dict__.get("_compute_weights")
    if cached is None or name not in cached:
        return param
    copy = cached[name]
    return CopyOf.apply(param, copy) if param.requires_grad and torch.is_grad_enabled() else copy


class CachedLinear(nn.Linear):
    """nn.Linear whose forward multiplies by compute_weight(self): same parameters, state_dict and hooks (a module
    becomes one by a class swap, moestack.memory.compute_weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, compute_weight(self), self.bias)
