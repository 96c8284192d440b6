"""The weight a forward multiplies by: a module's compute copy of a parameter when one is kept, else the parameter.

moestack.memory.compute_weights keeps bf16 copies of the Linear and expert weights, recast in place once per
optimizer step, in `module._compute_weights` (name -> tensor). A copy is a leaf that requires grad when its parameter
does; its owner moves each backward's gradient into the parameter's fp32 .grad (one fused add) and clears it. The
copy is one tensor at one address for the whole run: CUDA graphs record it as a static input and replay across
steps. Without copies (fp32 runs, FSDP2, FP8 layers) a forward reads the parameter itself and autocast (or FSDP2)
casts it as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_weight(module: nn.Module, name: str = "weight") -> torch.Tensor:
    cached = module.__dict__.get("_compute_weights")
    if cached is None or name not in cached:
        return getattr(module, name)
    return cached[name]


class CachedLinear(nn.Linear):
    """nn.Linear whose forward multiplies by compute_weight(self): same parameters, state_dict and hooks (a module
    becomes one by a class swap, moestack.memory.compute_weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, compute_weight(self), self.bias)
