"""DSA Triton backend: the sparse MQA attention autograd.Function and the dispatcher registration.

    sparse_mqa_attention_triton(q, kv, idx, v_dim, scale, dkv_mode=None)  ->  (o, lse)

Forward saves q, kv, idx, o and lse (no [T, K] intermediates); backward rebuilds P from lse. Both outputs are
differentiable (the lse gradient folds into Delta). dkv_mode picks the backward's dKV scatter (triton_attn_bwd):
"kmajor_ds" (atomics), or under torch.use_deterministic_algorithms(True) "sorted_ds" (a sorted segment sum).
"""

from __future__ import annotations

import torch

from moestack.ops.dsa.triton_attn_bwd import DKV_MODES, sparse_mqa_bwd
from moestack.ops.dsa.triton_attn_fwd import sparse_mqa_fwd


class _SparseMQAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, idx, v_dim, scale, dkv_mode):
        o, lse = sparse_mqa_fwd(q, kv, idx, v_dim, scale)
        ctx.save_for_backward(q, kv, idx, o, lse)
        ctx.scale, ctx.dkv_mode = scale, dkv_mode
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, kv, idx, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dkv = sparse_mqa_bwd(q, kv, idx, o, lse, do, dlse, ctx.scale, ctx.dkv_mode)
        return dq, dkv, None, None, None, None


def dkv_mode_default() -> str:
    """The backward's dKV mode when none is passed: the two-pass backward with atomics (H200, T=32768, H=64: 101 ms),
    or under torch.use_deterministic_algorithms(True) its sorted form (212 ms), without float atomics."""
    return "sorted_ds" if torch.are_deterministic_algorithms_enabled() else "kmajor_ds"


def sparse_mqa_attention_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    v_dim: int,
    scale: float,
    dkv_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,T,H,D], kv [B,S,D], idx [B,T,K] int32 (-1 = empty) -> (o [B,T,H,v_dim] q.dtype, lse [B,T,H] fp32).

    Same contract as reference.sparse_mqa_attention. D - v_dim and v_dim must be powers of two (64 / 512 in MLA).
    Packed documents (B == 1) need nothing extra: idx already keeps each query inside its document.
    """
    mode = dkv_mode or dkv_mode_default()
    if mode not in DKV_MODES:
        raise ValueError(f"dkv_mode '{mode}' is not one of {DKV_MODES}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q dtype {q.dtype} is not supported by the Triton DSA kernels; use fp32, fp16 or bf16")
    if kv.dtype != q.dtype:  # e.g. a bf16 query (autocast matmul) against an fp32 normalised latent
        kv = kv.to(q.dtype)
    return _SparseMQAttention.apply(q, kv, idx, v_dim, scale, mode)


def indexer_topk_triton(q_idx, k_idx, w, top_k, cu_seqlens=None):
    """Registered as backend "triton" of indexer_topk_from_inputs; see triton_indexer.indexer_topk_triton."""
    from moestack.ops.dsa.triton_indexer import indexer_topk_triton as _topk

    return _topk(q_idx, k_idx, w, top_k, cu_seqlens=cu_seqlens)


def attention_probs_target_triton(q, kv, scale, lse=None, idx=None, cu_seqlens=None):
    """Registered as backend "triton" of attention_probs_target; see triton_indexer.attention_probs_target_triton."""
    from moestack.ops.dsa.triton_indexer import attention_probs_target_triton as _target

    return _target(q, kv, scale, lse=lse, idx=idx, cu_seqlens=cu_seqlens)


def indexer_scores_at_triton(q_idx, k_idx, w, idx):
    """Registered as backend "triton" of indexer_scores_at; see triton_indexer_scores.indexer_scores_at_triton."""
    from moestack.ops.dsa.triton_indexer_scores import indexer_scores_at_triton as _scores

    return _scores(q_idx, k_idx, w, idx)
