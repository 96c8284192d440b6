"""DSA reference ops: lightning-indexer scores, top-k selection, sparse/dense MQA attention, indexer KL loss.

Pure PyTorch with fp32 math (autocast is switched off inside; fp64 inputs stay fp64): this file is the spec that
fast paths are tested against. The plain functions are loop-clear and materialise what they need; the
`*_blockwise` / `*_from_inputs` variants process query rows in blocks so long sequences fit in memory, and are
what the dispatcher registers as the "reference" backend. Derivations and conventions: README.md.

Legend: B batch, T queries, S keys (S == T, self-attention), H attention heads, D q/k dim (in MLA's MQA form
kv_lora + rope), V value dim (values are kv[..., :V]), K selected keys per query (top_k), Hi / Di indexer heads /
head dim, R rows in one query block, N packed documents (cu_seqlens [N+1], B == 1).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

NEG_INF = float("-inf")
DEFAULT_BLOCK_BYTES = 256 * 2**20  # transient bytes one query block may hold in the blockwise variants


# ----------------------------------------------------------------------------------------------- masks & helpers


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _no_autocast(x: torch.Tensor):
    """fp32 math must not be silently re-cast to bf16 by an enclosing autocast region."""
    if x.device.type in ("cpu", "cuda"):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()


def document_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """Document index [T] int64 of each token of a packed sequence with boundaries cu_seqlens [N+1] (0 .. T)."""
    cu = cu_seqlens.to(torch.int64)
    return torch.searchsorted(cu[1:], torch.arange(T, device=cu.device), right=True)


def visible_mask(
    rows: torch.Tensor, keys: torch.Tensor, doc_T: torch.Tensor | None = None
) -> torch.Tensor:
    """bool [R, S]: query position rows[r] may attend key position keys[s] (causal, same document)."""
    vis_RS = keys[None, :] <= rows[:, None]
    if doc_T is not None:
        vis_RS = vis_RS & (doc_T[keys][None, :] == doc_T[rows][:, None])
    return vis_RS


def causal_mask(T: int, device: torch.device | str, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """bool [T, T], True = visible: causal, and block-diagonal over the documents of cu_seqlens when given."""
    pos_T = torch.arange(T, device=device)
    doc_T = None if cu_seqlens is None else document_ids(cu_seqlens.to(device), T)
    return visible_mask(pos_T, pos_T, doc_T)


def gather_keys(x_BSX: torch.Tensor, idx_BTK: torch.Tensor) -> torch.Tensor:
    """x[b, idx[b, t, k]] -> [B, T, K, X]; -1 entries of idx read key 0 (callers mask them).

    A row lookup in the flattened [B*S, X] table via F.embedding: its backward is a sorted segment sum, ~35x
    faster on an H200 than the index_put backward of advanced indexing (measured on one query block).
    """
    B, S, X = x_BSX.shape
    rows = idx_BTK.long().clamp_min(0) + S * torch.arange(B, device=x_BSX.device)[:, None, None]
    return F.embedding(rows, x_BSX.reshape(B * S, X))


def _block_rows(T: int, bytes_per_row: int, max_bytes: int) -> int:
    return max(1, min(T, max_bytes // max(1, bytes_per_row)))


def _over_row_blocks(fn, rows: int, row_args: tuple, shared_args: tuple):
    """fn(*row_args[:, t0:t0+rows], *shared_args) per block of query rows, outputs concatenated on dim 1.

    Under autograd every block is an activation checkpoint: backward recomputes it, so only the block's inputs
    are saved. fn returns a tensor or a tuple of tensors, each with the query-row dim at 1.
    """
    T = row_args[0].shape[1]
    tensors = [a for a in (*row_args, *shared_args) if isinstance(a, torch.Tensor)]
    recompute = torch.is_grad_enabled() and any(a.requires_grad for a in tensors)
    outs = []
    for t0 in range(0, T, rows):
        args = (*(a[:, t0 : t0 + rows] for a in row_args), *shared_args)
        outs.append(checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args))
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts, dim=1) for parts in zip(*outs))
    return torch.cat(outs, dim=1)


# ------------------------------------------------------------------------------------------------ lightning indexer


def _indexer_logits(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_j w[t,j] ReLU(q[t,j] . k[s]): q [B,R,Hi,Di], k [B,S,Di], w [B,R,Hi] -> [B,R,S] (no mask)."""
    dt = _math_dtype(q_idx)
    dots_BRSH = torch.einsum("brhd,bsd->brsh", q_idx.to(dt), k_idx.to(dt))
    return torch.einsum("brsh,brh->brs", dots_BRSH.relu(), w.to(dt))


def indexer_scores(
    q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Lightning-indexer scores I[b,t,s] = sum_j w[b,t,j] * ReLU(q_idx[b,t,j] . k_idx[b,s]).

    q_idx [B,T,Hi,Di], k_idx [B,T,Di], w [B,T,Hi] (any float dtype) -> [B,T,T] fp32 (fp64 for fp64 inputs),
    -inf where s > t or (with cu_seqlens) s is in another document. Differentiable.
    """
    T = q_idx.shape[1]
    with _no_autocast(q_idx):
        I_BTS = _indexer_logits(q_idx, k_idx, w)
    return I_BTS.masked_fill(~causal_mask(T, q_idx.device, cu_seqlens), NEG_INF)


def indexer_scores_at(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Indexer scores of the selected keys only: idx [B,T,K] (-1 = none) -> [B,T,K] fp32, -inf at -1. Differentiable.

    Equals indexer_scores(...).gather(-1, idx) without forming the T x T matrix.
    """
    dt = _math_dtype(q_idx)
    with _no_autocast(q_idx):
        k_BTKD = gather_keys(k_idx.to(dt), idx)
        dots_BTKH = torch.einsum("bthd,btkd->btkh", q_idx.to(dt), k_BTKD)
        I_BTK = torch.einsum("btkh,bth->btk", dots_BTKH.relu(), w.to(dt))
    return I_BTK.masked_fill(idx < 0, NEG_INF)


def indexer_scores_at_blockwise(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w: torch.Tensor,
    idx: torch.Tensor,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> torch.Tensor:
    """indexer_scores_at over blocks of query rows (recomputed in backward): holds one block's [B,R,K,Di+Hi]."""
    B, T, Hi, Di = q_idx.shape
    rows = _block_rows(T, B * idx.shape[-1] * (Di + 2 * Hi) * 4, max_block_bytes)
    if rows >= T:
        return indexer_scores_at(q_idx, k_idx, w, idx)
    return _over_row_blocks(lambda q, w_, i, k: indexer_scores_at(q, k, w_, i), rows, (q_idx, w, idx), (k_idx,))


def indexer_topk(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k keys per query: scores [B,T,S] (-inf = invisible) -> idx [B,T,top_k] int32.

    Order within a row is by descending score; slots beyond the visible keys (query t sees t+1 keys) are -1.
    """
    S = scores.shape[-1]
    k = min(top_k, S)
    vals_BTk, idx_BTk = scores.topk(k, dim=-1)
    idx_BTk = idx_BTk.masked_fill(vals_BTk == NEG_INF, -1).to(torch.int32)
    if k < top_k:
        idx_BTk = F.pad(idx_BTk, (0, top_k - k), value=-1)
    return idx_BTk


@torch.no_grad()
def indexer_topk_from_inputs(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w: torch.Tensor,
    top_k: int,
    cu_seqlens: torch.Tensor | None = None,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> torch.Tensor:
    """indexer_topk(indexer_scores(q_idx, k_idx, w, cu_seqlens), top_k), computed over blocks of query rows.

    A block of rows [t0, t1) only scores keys [0, t1) (causality), so no full T x T fp32 matrix is ever held.
    Shapes as in indexer_scores; returns idx [B,T,top_k] int32 (-1 padded). No gradient.
    """
    B, T, Hi, _ = q_idx.shape
    doc_T = None if cu_seqlens is None else document_ids(cu_seqlens.to(q_idx.device), T)
    rows = _block_rows(T, B * T * (Hi + 2) * 4, max_block_bytes)
    pos_T = torch.arange(T, device=q_idx.device)
    out = []
    with _no_autocast(q_idx):
        for t0 in range(0, T, rows):
            t1 = min(T, t0 + rows)
            I_BRS = _indexer_logits(q_idx[:, t0:t1], k_idx[:, :t1], w[:, t0:t1])
            I_BRS = I_BRS.masked_fill(~visible_mask(pos_T[t0:t1], pos_T[:t1], doc_T), NEG_INF)
            out.append(indexer_topk(I_BRS, top_k))
    return torch.cat(out, dim=1)


# ------------------------------------------------------------------------------------------------ MQA attention


def _softmax_attend(logits: torch.Tensor, vis: torch.Tensor, values: torch.Tensor, eq: str):
    """Masked fp32 softmax over the last dim of logits, then values; returns (o, lse)."""
    logits = logits.masked_fill(~vis, NEG_INF)
    lse = logits.logsumexp(-1)
    p = torch.exp(logits - lse.masked_fill(lse == NEG_INF, 0.0)[..., None])  # empty rows -> p = 0, o = 0
    return torch.einsum(eq, p, values), lse


def sparse_mqa_attention(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, v_dim: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every head over its query's selected keys, in MQA form (one shared key/value latent per token).

    q [B,T,H,D], kv [B,S,D] (keys = kv, values = kv[..., :v_dim]), idx [B,T,K] int (-1 = empty slot).
    o[b,t,h] = sum_k softmax_k(scale * q[b,t,h] . kv[b,idx[b,t,k]]) * kv[b,idx[b,t,k],:v_dim]
    Returns o [B,T,H,v_dim] in q's dtype and lse [B,T,H] (natural-log sum of exp of the scaled logits) in fp32
    (fp64 for fp64 inputs). Softmax in fp32; differentiable in q and kv. Every query needs >= 1 selected key.
    """
    dt = _math_dtype(q)
    with _no_autocast(q):
        kv_BTKD = gather_keys(kv.to(dt), idx)
        logits_BTHK = torch.einsum("bthd,btkd->bthk", q.to(dt), kv_BTKD) * scale
        vis_BT1K = (idx >= 0)[:, :, None, :]
        o_BTHV, lse_BTH = _softmax_attend(logits_BTHK, vis_BT1K, kv_BTKD[..., :v_dim], "bthk,btkv->bthv")
    return o_BTHV.to(q.dtype), lse_BTH


def dense_mqa_attention(
    q: torch.Tensor, kv: torch.Tensor, v_dim: int, scale: float, cu_seqlens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over all visible keys in MQA form; shapes and outputs as in sparse_mqa_attention.

    With cu_seqlens (B == 1 packed documents) keys of other documents are invisible.
    """
    T = q.shape[1]
    dt = _math_dtype(q)
    with _no_autocast(q):
        kv32 = kv.to(dt)
        logits_BTHS = torch.einsum("bthd,bsd->bths", q.to(dt), kv32) * scale
        vis_1T1S = causal_mask(T, q.device, cu_seqlens)[None, :, None, :]
        o_BTHV, lse_BTH = _softmax_attend(logits_BTHS, vis_1T1S, kv32[..., :v_dim], "bths,bsv->bthv")
    return o_BTHV.to(q.dtype), lse_BTH


def sparse_mqa_attention_blockwise(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    v_dim: int,
    scale: float,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_mqa_attention over blocks of query rows, each block recomputed in backward (activation checkpoint).

    Same inputs/outputs/gradients; holds one block's gathered keys [B,R,K,D] and logits at a time instead of T's.
    """
    B, T, H, D = q.shape
    K = idx.shape[-1]
    rows = _block_rows(T, B * K * (D + 2 * H) * 4, max_block_bytes)
    if rows >= T:
        return sparse_mqa_attention(q, kv, idx, v_dim, scale)
    return _over_row_blocks(lambda q_, i, kv_: sparse_mqa_attention(q_, kv_, i, v_dim, scale), rows, (q, idx), (kv,))


# ------------------------------------------------------------------------------------------------ indexer KL loss


def _head_mean_probs(q_BRHD: torch.Tensor, keys: torch.Tensor, vis: torch.Tensor, scale: float, lse_BRH, eq: str):
    """sum_h softmax(scale * q_h . keys) over visible keys, one head at a time, L1-normalised."""
    p = None
    for h in range(q_BRHD.shape[2]):
        logits = (torch.einsum(eq, q_BRHD[:, :, h], keys) * scale).masked_fill(~vis, NEG_INF)
        lse_h = logits.logsumexp(-1) if lse_BRH is None else lse_BRH[:, :, h].to(logits.dtype)
        p_h = torch.exp(logits - lse_h[..., None])
        p = p_h if p is None else p + p_h
    return p / p.sum(-1, keepdim=True)


@torch.no_grad()
def attention_probs_target(
    q: torch.Tensor,
    kv: torch.Tensor,
    scale: float,
    lse: torch.Tensor | None = None,
    idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> torch.Tensor:
    """KL target of the indexer: the main attention distribution summed over heads, L1-normalised. No gradient.

    q [B,T,H,D], kv [B,S,D] as in the MQA attention ops. Dense (idx None): -> [B,T,S] over the causal (and
    same-document) keys. Sparse (idx [B,T,K]): -> [B,T,K] over the selected keys (0 at -1 slots).
    lse [B,T,H] from the attention op avoids recomputing the normaliser; it must match the key set (dense lse
    for dense, the sparse op's lse for idx). fp32 (fp64 for fp64 inputs). Heads are visited one at a time and
    query rows in blocks, so besides the output only one block's [B,R,S] map (or gathered [B,R,K,D] keys) is held.
    """
    B, T, H, D = q.shape
    dt = _math_dtype(q)
    pos_T = torch.arange(T, device=q.device)
    doc_T = None if cu_seqlens is None else document_ids(cu_seqlens.to(q.device), T)
    width = T * 3 if idx is None else idx.shape[-1] * (D + 3)
    rows = _block_rows(T, B * width * 4, max_block_bytes)
    out = []
    with _no_autocast(q):
        kv_ = kv.to(dt)
        for t0 in range(0, T, rows):
            t1 = min(T, t0 + rows)
            q_rows = q[:, t0:t1].to(dt)
            lse_rows = None if lse is None else lse[:, t0:t1]
            if idx is None:
                vis_1RS = visible_mask(pos_T[t0:t1], pos_T, doc_T)[None]
                out.append(_head_mean_probs(q_rows, kv_, vis_1RS, scale, lse_rows, "brd,bsd->brs"))
            else:
                idx_rows = idx[:, t0:t1]
                keys_BRKD = gather_keys(kv_, idx_rows)
                out.append(_head_mean_probs(q_rows, keys_BRKD, idx_rows >= 0, scale, lse_rows, "brd,brkd->brk"))
    return torch.cat(out, dim=1)


def indexer_kl_loss(
    index_scores: torch.Tensor, attn_probs_target: torch.Tensor, idx: torch.Tensor | None = None
) -> torch.Tensor:
    """KL(p || softmax(I)) per query, averaged over all B*T queries -> scalar fp32. Gradient flows into I only.

    Dense mode (idx None): index_scores [B,T,X] with -inf at invisible keys and p [B,T,X] over the same keys
    (X = S for all causal keys, or X = K for an already-selected set).
    Sparse mode (idx [B,T,K]): index_scores and p are [B,T,S]; both are restricted to the selected keys
    (p renormalised there) before the KL.
    p is treated as a constant (detached).
    """
    p = attn_probs_target.detach()
    dt = _math_dtype(index_scores)
    with _no_autocast(index_scores):
        I = index_scores.to(dt)
        p = p.to(dt)
        if idx is not None:
            valid = idx >= 0
            safe = idx.long().clamp_min(0)
            I = I.gather(-1, safe).masked_fill(~valid, NEG_INF)
            p = p.gather(-1, safe).masked_fill(~valid, 0.0)
            p = p / p.sum(-1, keepdim=True)
        vis = I != NEG_INF
        log_q = torch.log_softmax(I, dim=-1).masked_fill(~vis, 0.0)  # invisible keys carry p = 0
        kl_BT = (torch.xlogy(p, p) - p * log_q).sum(-1)
    return kl_BT.mean()
