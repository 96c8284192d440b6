"""Auxiliary losses (MoE balance loss, DSA indexer KL) that ride on the activations.

`attach_aux_loss(x, loss)` returns `x` unchanged; in backward it also sends gradient 1 * scale into `loss`.
The trainer never has to collect losses from inside the model, so the same mechanism works under activation
recompute and pipeline parallelism (each stage's backward reaches its own aux losses). The trainer sets the
scale for a step's forwards (e.g. 1 / grad_accum_steps) with `aux_loss_scale`; a forward reads it and its backward
uses that value (so a compiled forward, whose backward is traced ahead, is guarded on it rather than keeping the
value it was traced with).
"""

from __future__ import annotations

import contextlib

import torch

_SCALE = [1.0]


def set_aux_loss_scale(scale: float) -> None:
    _SCALE[0] = float(scale)


@contextlib.contextmanager
def aux_loss_scale(scale: float):
    """The scale for the forwards inside; the caller's is put back after (the scale is process-wide: a trainer's
    1 / accum left behind would scale the aux losses of every later model in the process)."""
    previous = _SCALE[0]
    set_aux_loss_scale(scale)
    try:
        yield
    finally:
        _SCALE[0] = previous


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype, ctx.loss_device = loss.shape, loss.dtype, loss.device
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        grad_loss = torch.full(ctx.loss_shape, ctx.scale, dtype=ctx.loss_dtype, device=ctx.loss_device)
        return grad_x, grad_loss, None


def attach_aux_loss(x: torch.Tensor, loss: torch.Tensor | None) -> torch.Tensor:
    """Return x; make backward through x also backpropagate d(loss)=scale. No-op if loss is None or needs no grad."""
    if loss is None or not loss.requires_grad or not torch.is_grad_enabled():
        return x
    return _AttachAuxLoss.apply(x, loss, _SCALE[0])
