"""Indexer scores at the selected keys, forward and backward in Triton (the KL loss's differentiable input).

I[t, k] = sum_j w[t, j] ReLU(q_idx[t, j] . k_idx[idx[t, k]])   (-inf at -1 slots), as
reference.indexer_scores_at, without the [T, K, Di] gathered keys or [T, K, Hi] dots of the torch version.
One program per token loops over its K slots in blocks: gather [BLOCK_K, Di] key rows, [Hi, BLOCK_K] dots on
the tensor cores, ReLU, weight, sum over indexer heads. Backward (same loop, G = dI w 1[dot > 0]):
dq[j] = sum_k G[j,k] k_k, dw[j] = sum_k dI[k] ReLU(dot[j,k]) in registers; dk[idx[k]] += sum_j G[j,k] q_j by
fp32 atomics (keys are shared by many queries). The KL itself (softmax over the K scores) stays in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestack.ops.dsa.triton_attn_fwd import INTERPRET


def _block_k() -> int:
    return 16 if INTERPRET else 64


@triton.jit(do_not_specialize=["T", "Hi", "K"])
def _scores_at_fwd_kernel(
    Q, KI, W, IDX, OUT,
    T, Hi, K,
    s_qb, s_qt, s_qh, s_kb, s_ks, s_wb, s_wt, s_ib, s_it,
    Di: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    b = n // T
    t = n % T
    offs_j = tl.arange(0, HP)
    offs_d = tl.arange(0, DP)
    mask_j = offs_j < Hi
    mask_d = offs_d < Di
    q = tl.load(Q + b * s_qb + t * s_qt + offs_j[:, None] * s_qh + offs_d[None, :],
                mask=mask_j[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
    w = tl.load(W + b * s_wb + t * s_wt + offs_j, mask=mask_j, other=0.0).to(tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ids = tl.load(IDX + b * s_ib + t * s_it + offs_k, mask=offs_k < K, other=-1)
        valid = ids >= 0
        rows = KI + b * s_kb + tl.where(valid, ids, 0).to(tl.int64)[:, None] * s_ks
        k = tl.load(rows + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k))  # [HP, BLOCK_K]
        score = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)
        tl.store(OUT + n * K + offs_k, tl.where(valid, score, float("-inf")), mask=offs_k < K)


@triton.jit(do_not_specialize=["T", "Hi", "K"])
def _scores_at_bwd_kernel(
    Q, KI, W, IDX, DI, DQ, DKI, DW,
    T, Hi, K,
    s_qb, s_qt, s_qh, s_kb, s_ks, s_wb, s_wt, s_ib, s_it,
    Di: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    b = n // T
    t = n % T
    offs_j = tl.arange(0, HP)
    offs_d = tl.arange(0, DP)
    mask_j = offs_j < Hi
    mask_d = offs_d < Di
    q_ptrs = b * s_qb + t * s_qt + offs_j[:, None] * s_qh + offs_d[None, :]
    q = tl.load(Q + q_ptrs, mask=mask_j[:, None] & mask_d[None, :], other=0.0)
    w = tl.load(W + b * s_wb + t * s_wt + offs_j, mask=mask_j, other=0.0).to(tl.float32)
    dq = tl.zeros([HP, DP], dtype=tl.float32)
    dw = tl.zeros([HP], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ids = tl.load(IDX + b * s_ib + t * s_it + offs_k, mask=offs_k < K, other=-1)
        valid = ids >= 0
        row = tl.where(valid, ids, 0).to(tl.int64)
        k = tl.load(
            KI + b * s_kb + row[:, None] * s_ks + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0
        )
        d_i = tl.load(DI + n * K + offs_k, mask=(offs_k < K) & valid, other=0.0)
        s = tl.dot(q, tl.trans(k))
        dw += tl.sum(tl.maximum(s, 0.0) * d_i[None, :], 1)
        g = tl.where(s > 0.0, w[:, None] * d_i[None, :], 0.0).to(q.dtype)  # [HP, BLOCK_K]
        dq += tl.dot(g, k)
        dk = tl.dot(tl.trans(g), q)  # [BLOCK_K, DP]
        dst = DKI + (b * T + row)[:, None] * Di + offs_d[None, :]  # fp32 [B, T, Di] contiguous
        tl.atomic_add(dst, dk, mask=valid[:, None] & mask_d[None, :], sem="relaxed")
    tl.store(DQ + q_ptrs, dq.to(DQ.dtype.element_ty), mask=mask_j[:, None] & mask_d[None, :])
    tl.store(DW + b * s_wb + t * s_wt + offs_j, dw.to(DW.dtype.element_ty), mask=mask_j)


def _launch(kernel, q, k, w, idx, *bufs):
    B, T, Hi, Di = q.shape
    K = idx.shape[-1]
    HP, DP = max(16, triton.next_power_of_2(Hi)), max(16, triton.next_power_of_2(Di))
    kernel[(B * T,)](
        q, k, w, idx, *bufs,
        T, Hi, K,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), w.stride(0), w.stride(1),
        idx.stride(0), idx.stride(1),
        Di=Di, HP=HP, DP=DP, BLOCK_K=_block_k(),
        num_warps=4, num_stages=2 if not INTERPRET else 1,
    )  # fmt: skip


class _IndexerScoresAt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_idx, k_idx, w, idx):
        q, k, wc = q_idx.contiguous(), k_idx.to(q_idx.dtype).contiguous(), w.contiguous()
        idx = idx.to(torch.int32).contiguous()
        out = torch.full(idx.shape, float("nan"), device=q.device, dtype=torch.float32)
        _launch(_scores_at_fwd_kernel, q, k, wc, idx, out)
        ctx.save_for_backward(q, k, wc, idx)
        ctx.k_dtype = k_idx.dtype
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, w, idx = ctx.saved_tensors
        d_out = torch.nan_to_num(d_out.float(), nan=0.0, posinf=0.0, neginf=0.0).contiguous()
        dq = torch.full_like(q, float("nan"))
        dw = torch.full_like(w, float("nan"))
        dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
        _launch(_scores_at_bwd_kernel, q, k, w, idx, d_out, dq, dk, dw)
        return dq, dk.to(ctx.k_dtype), dw, None


def indexer_scores_at_triton(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, idx: torch.Tensor):
    """q_idx [B,T,Hi,Di], k_idx [B,S,Di], w [B,T,Hi], idx [B,T,K] int32 -> I [B,T,K] fp32 (-inf at -1); differentiable
    in q_idx, k_idx and w. Same contract as reference.indexer_scores_at (k_idx is [B, T, Di], S == T)."""
    if q_idx.dim() != 4 or k_idx.dim() != 3 or w.dim() != 3 or idx.dim() != 3:
        raise ValueError("q_idx [B,T,Hi,Di], k_idx [B,T,Di], w [B,T,Hi], idx [B,T,K] expected")
    if k_idx.shape[1] != q_idx.shape[1]:
        raise ValueError(f"k_idx has {k_idx.shape[1]} rows, q_idx {q_idx.shape[1]}: self-attention keys only (S == T)")
    return _IndexerScoresAt.apply(q_idx, k_idx, w, idx)
