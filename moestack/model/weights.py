"""The weight a forward multiplies by: a module's compute copy of a parameter when one is kept, else the parameter.

moestack.memory.compute_weights keeps bf16 copies of the Linear and expert weights, cast once per optimizer step,
in `module._compute_weights` (name -> tensor, differentiable back to the fp32 parameter); without it (fp32 runs,
FSDP2, FP8 layers) a forward reads the parameter itself and autocast (or FSDP2) casts it as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_weight(module: nn.Module, name: str = "weight") -> torch.Tensor:
    cached = module.__dict__.get("_compute_weights")
    if cached is not None and name in cached:
        return cached[name]
    return getattr(module, name)


class CachedLinear(nn.Linear):
    """nn.Linear whose forward multiplies by compute_weight(self): same parameters, state_dict and hooks (a module
    becomes one by a class swap, moestack.memory.compute_weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, compute_weight(self), self.bias)
