"""KDA's chunked recurrence and short conv as torch.library custom ops: what a compiled block calls (one graph node
each, no break; CUDA graphs capture their kernels; selective recompute sees them by name). Eager calls run the entry
points' own paths; these run the same kernels.

    moestack::chunk_kda (+ _backward)         chunk_kda's picked backend; the Triton backward from the inputs alone
    moestack::short_conv_silu (+ _backward)   the fused conv + SiLU (short_conv.py)

Backends without a backward of their own (the reference: CPU, fp64) differentiate their forward again in the
backward op (torch.func.vjp): a test path, never the GPU's.
"""

from __future__ import annotations

import torch
from torch.library import custom_op


def _none_if_empty(t: torch.Tensor | None) -> torch.Tensor | None:
    """Custom ops return no None: an empty tensor stands for "no such output"."""
    return None if t is None or t.numel() == 0 else t


# ---------------------------------------------------------------------------------------------------------------
# chunk_kda: (o [B, T, H, V], final state [N, H, K, V] or empty)


@custom_op("moestack::chunk_kda", mutates_args=())
def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
              initial_state: torch.Tensor | None, output_final_state: bool, cu_seqlens: torch.Tensor | None,
              backend: str | None, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from moestack.ops.kda import chunk_kda_eager

    with torch.no_grad():
        o, ht = chunk_kda_eager(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, backend,
                                chunk_size)
    return o.contiguous(), (ht.contiguous() if ht is not None else _no_state(q, v))


def _no_state(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty(0, dtype=torch.promote_types(v.dtype, torch.float32))


@chunk_kda.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, backend, chunk_size):
    B, T, H, K = q.shape
    o = v.new_empty(B, T, H, v.shape[-1])
    if not output_final_state:
        return o, _no_state(q, v)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return o, q.new_empty(N, H, K, v.shape[-1], dtype=torch.promote_types(v.dtype, torch.float32))


@custom_op("moestack::chunk_kda_backward", mutates_args=())
def chunk_kda_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       scale: float, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                       backend: str | None, chunk_size: int, do: torch.Tensor,
                       dht: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                          torch.Tensor, torch.Tensor]:
    from moestack.ops import tuned
    from moestack.ops.kda import REGISTRY, chunk_kda_eager

    if REGISTRY.pick(backend, q, lambda: tuned.kda_key(q)).name == "triton":
        from moestack.ops.kda.triton_op import kda_triton_backward

        grads = kda_triton_backward(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht)
    else:
        # torch.func: an op's body runs below the autograd dispatch key, where torch.autograd records nothing
        def forward(*primals):
            o, ht = chunk_kda_eager(*primals[:5], scale, primals[5] if len(primals) > 5 else None,
                                    dht is not None, cu_seqlens, backend, chunk_size)
            return (o,) if dht is None else (o, ht)

        primals = (q, k, v, g, beta) + (() if initial_state is None else (initial_state,))
        _, vjp = torch.func.vjp(forward, *primals)
        grads = list(vjp((do,) if dht is None else (do, dht))) + [None] * (6 - len(primals))
    like = (q, k, v, g, beta, initial_state)
    return tuple(q.new_empty(0) if d is None else d.to(x.dtype).contiguous() for d, x in zip(grads, like))


@chunk_kda_backward.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, backend, chunk_size, do, dht):
    dh0 = q.new_empty(0) if initial_state is None else torch.empty_like(initial_state)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def _kda_setup(ctx, inputs, output) -> None:
    q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, backend, chunk_size = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.cfg = (scale, backend, chunk_size)
    ctx.output_final_state = output_final_state


def _kda_backward(ctx, do, dht):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    scale, backend, chunk_size = ctx.cfg
    if not ctx.output_final_state:
        dht = None
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0 = chunk_kda_backward(q, k, v, g, beta, scale, initial_state, cu_seqlens, backend,
                                                    chunk_size, do.contiguous(), dht)
    return dq, dk, dv, dg, dbeta, None, _none_if_empty(dh0), None, None, None, None


chunk_kda.register_autograd(_kda_backward, setup_context=_kda_setup)

# ---------------------------------------------------------------------------------------------------------------
# short_conv_silu: silu(causal depthwise conv(x, w)) [B, T, C]


@custom_op("moestack::short_conv_silu", mutates_args=())
def short_conv_silu(x: torch.Tensor, w: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
    from moestack.ops.kda.short_conv import _ShortConvSiLU

    with torch.no_grad():
        return _ShortConvSiLU.apply(x, w, pos)


@short_conv_silu.register_fake
def _(x, w, pos):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@custom_op("moestack::short_conv_silu_backward", mutates_args=())
def short_conv_silu_backward(x: torch.Tensor, w: torch.Tensor, pos: torch.Tensor | None,
                             dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from moestack.ops.kda.short_conv import short_conv_silu_grads

    return short_conv_silu_grads(x, w, pos, dy)


@short_conv_silu_backward.register_fake
def _(x, w, pos, dy):
    dense = torch.contiguous_format
    return torch.empty_like(x, memory_format=dense), torch.empty_like(w, memory_format=dense)


def _conv_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _conv_backward(ctx, dy):
    x, w, pos = ctx.saved_tensors
    dx, dw = short_conv_silu_backward(x, w, pos, dy.contiguous())
    return dx, dw, None


short_conv_silu.register_autograd(_conv_backward, setup_context=_conv_setup)
