"""DSA's ops as torch.library custom ops: what a compiled block calls (one graph node each, no graph break; CUDA
graphs capture their kernels; selective recompute sees them by name). Each forward runs the eager entry's own path
(moestack.ops.dsa: the backend it picks for these inputs, the same kernels); eager calls never come here.

    moestack::dsa_sparse_mqa_attention (+ _backward)   (o, lse); the Triton backward from the saved o and lse
    moestack::dsa_indexer_scores_at (+ _backward)      scores at the selection; the Triton backward kernel
    moestack::dsa_indexer_kl_loss (+ _backward)        the KL in torch (every backend)
    moestack::dsa_indexer_topk_from_inputs             int32 indices, no gradient
    moestack::dsa_attention_probs_target               the KL target, no gradient (the entry passes detached inputs)

A backward op redoes the picked backend's choice from the same inputs (deterministic for a shape). Backends without
a backward of their own (the reference, pure PyTorch, and the KL everywhere) run their forward again there and
differentiate it with torch.autograd (`_vjp`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch.library import custom_op


def _own(t: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """t contiguous and sharing no storage with `inputs` (a custom op's outputs may not alias its inputs)."""
    t = t.contiguous()
    ptr = t.untyped_storage().data_ptr()
    if t.numel() and any(x is not None and x.numel() and x.untyped_storage().data_ptr() == ptr for x in inputs):
        t = t.clone()
    return t


def _vjp(fn: Callable, primals: tuple[torch.Tensor, ...], cotangents: tuple[torch.Tensor | None, ...]):
    """Gradients of fn(*primals) (a tensor or a tuple) for the given output cotangents (None: no gradient), by running
    fn again under torch.autograd; zeros for a primal fn does not use. An op body runs below the autograd dispatch key
    (nothing would be recorded), so the recomputation lifts that exclusion: torch.func.vjp would not do, it refuses
    the saved-tensor hooks of the reference's activation checkpoints (blockwise over query rows at long T)."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.AutogradFunctionality, False), \
            torch.enable_grad():
        leaves = tuple(p.detach().requires_grad_() for p in primals)
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, c) for o, c in zip(outs, cotangents, strict=True) if c is not None and o.requires_grad]
        grads = (None,) * len(leaves)
        if pairs:
            grads = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True)
    return tuple(torch.zeros_like(p) if g is None else g.to(p.dtype) for g, p in zip(grads, primals, strict=True))


def _math(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# sparse MQA attention: q [B,T,H,D], kv [B,S,D], idx [B,T,K] -> (o [B,T,H,v_dim] q.dtype, lse [B,T,H] fp32)


@custom_op("moestack::dsa_sparse_mqa_attention", mutates_args=())
def sparse_mqa_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, v_dim: int, scale: float,
                         backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    from moestack.ops.dsa import sparse_mqa_attention_eager

    with torch.no_grad():
        o, lse = sparse_mqa_attention_eager(q, kv, idx, v_dim, scale, backend=backend)
    return _own(o, q, kv), _own(lse, q, kv)


@sparse_mqa_attention.register_fake
def _(q, kv, idx, v_dim, scale, backend):
    B, T, H, _ = q.shape
    return q.new_empty(B, T, H, v_dim), q.new_empty(B, T, H, dtype=_math(q.dtype))


@custom_op("moestack::dsa_sparse_mqa_attention_backward", mutates_args=())
def sparse_mqa_attention_backward(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, o: torch.Tensor,
                                  lse: torch.Tensor, do: torch.Tensor | None, dlse: torch.Tensor | None, v_dim: int,
                                  scale: float, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    from moestack.ops.dsa import attention_backend, sparse_mqa_attention_eager

    if attention_backend(q, idx, backend) == "triton":  # the Function's backward on what its forward saved
        from moestack.ops.dsa.triton_op import _SparseMQAttention, dkv_mode_default

        kv_q = kv.to(q.dtype)  # as sparse_mqa_attention_triton; the cast's backward below
        ctx = SimpleNamespace(saved_tensors=(q, kv_q, idx, o, lse), scale=scale, dkv_mode=dkv_mode_default())
        dq, dkv = _SparseMQAttention.backward(ctx, do, dlse)[:2]
        dkv = dkv.to(kv.dtype)
    else:
        dq, dkv = _vjp(lambda q_, kv_: sparse_mqa_attention_eager(q_, kv_, idx, v_dim, scale, backend=backend),
                       (q, kv), (do, dlse))
    inputs = (q, kv, o, lse, do, dlse)
    return _own(dq, *inputs), _own(dkv, *inputs)


@sparse_mqa_attention_backward.register_fake
def _(q, kv, idx, o, lse, do, dlse, v_dim, scale, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(kv, memory_format=torch.contiguous_format)


def _attn_setup(ctx, inputs, output) -> None:
    q, kv, idx, v_dim, scale, backend = inputs
    ctx.save_for_backward(q, kv, idx, *output)
    ctx.cfg = (v_dim, scale, backend)


def _attn_backward(ctx, do, dlse):
    q, kv, idx, o, lse = ctx.saved_tensors
    dq, dkv = sparse_mqa_attention_backward(q, kv, idx, o, lse, do, dlse, *ctx.cfg)
    return dq, dkv, None, None, None, None


sparse_mqa_attention.register_autograd(_attn_backward, setup_context=_attn_setup)

# ---------------------------------------------------------------------------------------------------------------
# indexer scores at the selection: q_idx [B,T,Hi,Di], k_idx [B,T,Di], w [B,T,Hi], idx [B,T,K] -> [B,T,K] fp32


@custom_op("moestack::dsa_indexer_scores_at", mutates_args=())
def indexer_scores_at(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, idx: torch.Tensor,
                      backend: str | None) -> torch.Tensor:
    from moestack.ops.dsa import indexer_scores_at_eager

    with torch.no_grad():
        return _own(indexer_scores_at_eager(q_idx, k_idx, w, idx, backend=backend), q_idx, k_idx, w)


@indexer_scores_at.register_fake
def _(q_idx, k_idx, w, idx, backend):
    return q_idx.new_empty(idx.shape, dtype=_math(q_idx.dtype))


@custom_op("moestack::dsa_indexer_scores_at_backward", mutates_args=())
def indexer_scores_at_backward(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, idx: torch.Tensor,
                               d_out: torch.Tensor, backend: str | None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from moestack.ops.dsa import indexer_scores_at_eager, select_backend

    if select_backend("indexer_scores_at", q_idx, backend) == "triton":  # the Function's backward, its saved tensors
        from moestack.ops.dsa.triton_indexer_scores import _IndexerScoresAt

        saved = (q_idx.contiguous(), k_idx.to(q_idx.dtype).contiguous(), w.contiguous(),
                 idx.to(torch.int32).contiguous())
        grads = _IndexerScoresAt.backward(SimpleNamespace(saved_tensors=saved, k_dtype=k_idx.dtype), d_out)[:3]
    else:
        grads = _vjp(lambda q_, k_, w_: indexer_scores_at_eager(q_, k_, w_, idx, backend=backend),
                     (q_idx, k_idx, w), (d_out,))
    return tuple(_own(g, q_idx, k_idx, w, d_out) for g in grads)


@indexer_scores_at_backward.register_fake
def _(q_idx, k_idx, w, idx, d_out, backend):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q_idx, k_idx, w))


def _scores_setup(ctx, inputs, output) -> None:
    q_idx, k_idx, w, idx, backend = inputs
    ctx.save_for_backward(q_idx, k_idx, w, idx)
    ctx.backend = backend


def _scores_backward(ctx, d_out):
    dq, dk, dw = indexer_scores_at_backward(*ctx.saved_tensors, d_out, ctx.backend)
    return dq, dk, dw, None, None


indexer_scores_at.register_autograd(_scores_backward, setup_context=_scores_setup)

# ---------------------------------------------------------------------------------------------------------------
# indexer KL loss: scores, target [B,T,X] (idx [B,T,K] in the sparse-over-S form) -> scalar


@custom_op("moestack::dsa_indexer_kl_loss", mutates_args=())
def indexer_kl_loss(index_scores: torch.Tensor, attn_probs_target: torch.Tensor, idx: torch.Tensor | None,
                    backend: str | None) -> torch.Tensor:
    from moestack.ops.dsa import indexer_kl_loss_eager

    with torch.no_grad():
        loss = indexer_kl_loss_eager(index_scores, attn_probs_target, idx, backend=backend)
    return _own(loss, index_scores, attn_probs_target)


@indexer_kl_loss.register_fake
def _(index_scores, attn_probs_target, idx, backend):
    return index_scores.new_empty((), dtype=_math(index_scores.dtype))


@custom_op("moestack::dsa_indexer_kl_loss_backward", mutates_args=())
def indexer_kl_loss_backward(index_scores: torch.Tensor, attn_probs_target: torch.Tensor, idx: torch.Tensor | None,
                             grad: torch.Tensor, backend: str | None) -> torch.Tensor:
    from moestack.ops.dsa import indexer_kl_loss_eager

    (d_scores,) = _vjp(lambda s: indexer_kl_loss_eager(s, attn_probs_target, idx, backend=backend),
                       (index_scores,), (grad,))
    return _own(d_scores, index_scores, attn_probs_target, grad)


@indexer_kl_loss_backward.register_fake
def _(index_scores, attn_probs_target, idx, grad, backend):
    return torch.empty_like(index_scores, memory_format=torch.contiguous_format)


def _kl_setup(ctx, inputs, output) -> None:
    index_scores, attn_probs_target, idx, backend = inputs
    ctx.save_for_backward(index_scores, attn_probs_target, idx)
    ctx.backend = backend


def _kl_backward(ctx, grad):
    index_scores, target, idx = ctx.saved_tensors
    return indexer_kl_loss_backward(index_scores, target, idx, grad, ctx.backend), None, None, None


indexer_kl_loss.register_autograd(_kl_backward, setup_context=_kl_setup)

# ---------------------------------------------------------------------------------------------------------------
# no gradient: the indexer's top-k (int32) and the KL target


@custom_op("moestack::dsa_indexer_topk_from_inputs", mutates_args=())
def indexer_topk_from_inputs(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, top_k: int,
                             cu_seqlens: torch.Tensor | None, backend: str | None) -> torch.Tensor:
    from moestack.ops.dsa import indexer_topk_from_inputs_eager

    with torch.no_grad():
        idx = indexer_topk_from_inputs_eager(q_idx, k_idx, w, top_k, cu_seqlens=cu_seqlens, backend=backend)
    return _own(idx, cu_seqlens)


@indexer_topk_from_inputs.register_fake
def _(q_idx, k_idx, w, top_k, cu_seqlens, backend):
    return q_idx.new_empty(q_idx.shape[0], q_idx.shape[1], top_k, dtype=torch.int32)


@custom_op("moestack::dsa_attention_probs_target", mutates_args=())
def attention_probs_target(q: torch.Tensor, kv: torch.Tensor, scale: float, lse: torch.Tensor | None,
                           idx: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                           backend: str | None) -> torch.Tensor:
    from moestack.ops.dsa import attention_probs_target_eager

    with torch.no_grad():
        p = attention_probs_target_eager(q, kv, scale, lse, idx, cu_seqlens=cu_seqlens, backend=backend)
    return _own(p, q, kv, lse)


@attention_probs_target.register_fake
def _(q, kv, scale, lse, idx, cu_seqlens, backend):
    B, T = q.shape[:2]
    return q.new_empty(B, T, kv.shape[1] if idx is None else idx.shape[-1], dtype=_math(q.dtype))
