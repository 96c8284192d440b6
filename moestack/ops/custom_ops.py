"""torch.library custom ops at the autograd.Function seam of Triton entry points: what a compiled block calls instead
of breaking its graph (moestack/ops/opaque.py is the boundary for the entries that have none yet).

An entry with a custom op calls it while torch.compile traces (`torch.compiler.is_compiling()`), its
autograd.Function otherwise: the same kernels either way. Under compile the op is one opaque node of the graph
(register_fake gives its output shapes, register_autograd its backward, itself a custom op), so the graph runs
through it, CUDA graphs capture it, and selective recompute policies see it by name (torch.ops.moestack.*).

    moestack::fused_glu (+ _backward)       the MoE experts' fused GLU activation (moe/triton_activation.py)
    moestack::gated_rmsnorm (+ _backward)   KDA's output norm and gate (kda/gated_norm.py)

The other custom ops live beside their op: KDA's chunked recurrence and short conv (kda/custom_ops.py), DSA's
attention and indexer (dsa/custom_ops.py), the MoE router, dispatch, gather, combine and grouped GEMM
(moe/custom_ops.py), the batch quantile solve (moe/quantile.py). Still graph boundaries (@opaque): the FP8 GEMMs.

The kernel modules are imported inside the op bodies, so importing this module needs no Triton.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.library import custom_op

# ---------------------------------------------------------------------------------------------------------------
# fused GLU: gate_up [N, 2I] -> act(gate, up) [N, I]


@custom_op("moestack::fused_glu", mutates_args=())
def fused_glu(gate_up: torch.Tensor, kind: str, beta: float, lin_beta: float) -> torch.Tensor:
    from moestack.ops.moe.triton_activation import _FusedGLU

    with torch.no_grad():
        return _FusedGLU.apply(gate_up, kind, beta, lin_beta)


@fused_glu.register_fake
def _(gate_up, kind, beta, lin_beta):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@custom_op("moestack::fused_glu_backward", mutates_args=())
def fused_glu_backward(gate_up: torch.Tensor, da: torch.Tensor, kind: str, beta: float,
                       lin_beta: float) -> torch.Tensor:
    from moestack.ops.moe.triton_activation import glu_backward

    return glu_backward(gate_up.contiguous(), da, kind, beta, lin_beta)


@fused_glu_backward.register_fake
def _(gate_up, da, kind, beta, lin_beta):
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


def _glu_setup(ctx, inputs, output) -> None:
    gate_up, kind, beta, lin_beta = inputs
    ctx.save_for_backward(gate_up)
    ctx.cfg = (kind, beta, lin_beta)


def _glu_backward(ctx, da):
    (gate_up,) = ctx.saved_tensors
    return fused_glu_backward(gate_up, da, *ctx.cfg), None, None, None


fused_glu.register_autograd(_glu_backward, setup_context=_glu_setup)

# ---------------------------------------------------------------------------------------------------------------
# gated RMSNorm: RMSNorm(o) * weight * act(z) over the last dim V


@custom_op("moestack::gated_rmsnorm", mutates_args=())
def gated_rmsnorm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, act: str) -> torch.Tensor:
    from moestack.ops.kda.gated_norm import _ACTS, _GatedRMSNorm

    with torch.no_grad():
        return _GatedRMSNorm.apply(o, z, weight, eps, _ACTS[act]).contiguous()


@gated_rmsnorm.register_fake
def _(o, z, weight, eps, act):
    return torch.empty_like(z, memory_format=torch.contiguous_format)


@custom_op("moestack::gated_rmsnorm_backward", mutates_args=())
def gated_rmsnorm_backward(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float,
                           act: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from moestack.ops.kda.gated_norm import _ACTS, _GatedRMSNorm

    V = o.shape[-1]
    ctx = SimpleNamespace(saved_tensors=(o.reshape(-1, V).contiguous(), z.reshape(-1, V).contiguous(), weight),
                          eps=eps, act=_ACTS[act], shapes=(o.shape, z.shape))
    do, dz, dw, _, _ = _GatedRMSNorm.backward(ctx, dy)
    return do.contiguous(), dz.contiguous(), dw


@gated_rmsnorm_backward.register_fake
def _(o, z, weight, dy, eps, act):
    return (torch.empty_like(o, memory_format=torch.contiguous_format),
            torch.empty_like(z, memory_format=torch.contiguous_format), torch.empty_like(weight))


def _norm_setup(ctx, inputs, output) -> None:
    o, z, weight, eps, act = inputs
    ctx.save_for_backward(o, z, weight)
    ctx.cfg = (eps, act)


def _norm_backward(ctx, dy):
    o, z, weight = ctx.saved_tensors
    do, dz, dw = gated_rmsnorm_backward(o, z, weight, dy, *ctx.cfg)
    return do, dz, dw, None, None


gated_rmsnorm.register_autograd(_norm_backward, setup_context=_norm_setup)
