"""Gated MLPs: the GLU activations (SiTU-GLU, SwiGLU) and the dense GLU MLP.

The dense first layer and the fused shared experts of the MoE are both a `GLUMLP`; the routed experts use
`glu_activation` on their stacked weights (moestack/model/moe.py).

Legend: N rows (tokens), D hidden size, I intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("situ_glu", "swiglu")


def glu_activation(
    gate: torch.Tensor, up: torch.Tensor, kind: str, situ_beta: float = 4.0, situ_linear_beta: float = 25.0
) -> torch.Tensor:
    """The gated activation act(gate, up), elementwise; gate and up have the same shape [..., I].

    kind "situ_glu": b*tanh(g/b)*sigmoid(g) * c*tanh(u/c) with b = situ_beta, c = situ_linear_beta (a bounded
        SwiGLU, Kimi K3). Computed in at least fp32 (fp64 stays fp64) and cast back to gate's dtype.
    kind "swiglu": silu(g) * u, in the input dtype.
    """
    if kind == "situ_glu":
        dtype = torch.promote_types(gate.dtype, torch.float32)
        g, u = gate.to(dtype), up.to(dtype)
        act_g = situ_beta * torch.tanh(g / situ_beta) * torch.sigmoid(g)
        out = act_g * (situ_linear_beta * torch.tanh(u / situ_linear_beta))
        return out.to(gate.dtype)
    if kind == "swiglu":
        return F.silu(gate) * up
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {kind!r}")


class GLUMLP(nn.Module):
    """down_proj(act(gate_proj(x), up_proj(x))), no biases. x [..., D] -> [..., D]."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "situ_glu",
        situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.situ_beta = situ_beta
        self.situ_linear_beta = situ_linear_beta
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = glu_activation(self.gate_proj(x), self.up_proj(x), self.activation, self.situ_beta, self.situ_linear_beta)
        return self.down_proj(a)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=std)
