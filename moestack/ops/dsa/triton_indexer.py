"""Lightning-indexer top-k, phase A: Triton block scoring + torch.topk over chunks of query rows.

For a chunk of query rows [t0, t1) a Triton kernel writes the scores I[t, s] = sum_j w[t,j] ReLU(q[t,j] . k[s])
for keys s < t1 only (causal; -inf outside the document with cu_seqlens), tiles above the diagonal are skipped
and stay -inf; torch.topk then selects per row (reference.indexer_topk: order by descending score, -1 padded).
Only one chunk's [B, R, t1] fp32 block is ever held (CHUNK_BYTES), never T x T. A fused running top-k in the
kernel (no score block in memory at all) is the next step; this version is the correct blockwise baseline.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestack.ops.dsa import reference as ref
from moestack.ops.dsa.triton_attn_fwd import INTERPRET

CHUNK_BYTES = 1 << 30  # fp32 score block of one chunk of query rows


def _configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_T": 16, "BLOCK_S": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_T": bt, "BLOCK_S": bs}, num_warps=w, num_stages=s)
        for bt, bs, w, s in [(64, 128, 4, 3), (128, 128, 8, 3)]
    ]


@triton.autotune(configs=_configs(), key=["Hi", "DP"], restore_value=["OUT"])
@triton.jit(do_not_specialize=["t0", "t1", "Hi"])
def _indexer_scores_kernel(
    Q, KI, W, DOC, OUT,
    t0, t1, Hi,
    s_qb, s_qt, s_qh, s_kb, s_ks, s_wb, s_wt, s_ob, s_or,
    Di: tl.constexpr, DP: tl.constexpr, HAS_DOC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """OUT[b, t - t0, s] = I[b, t, s] for t in [t0, t1), s < t1, visible; invisible entries are left as they are
    (the caller fills OUT with -inf)."""
    row0 = t0 + tl.program_id(0) * BLOCK_T
    key0 = tl.program_id(1) * BLOCK_S
    b = tl.program_id(2).to(tl.int64)
    if key0 <= row0 + BLOCK_T - 1:  # tiles wholly above the diagonal see nothing
        rows = row0 + tl.arange(0, BLOCK_T)
        keys = key0 + tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, DP)
        mask_d = offs_d < Di
        mask_t = rows < t1
        mask_s = keys < t1
        k = tl.load(KI + b * s_kb + keys[:, None].to(tl.int64) * s_ks + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
        acc = tl.zeros([BLOCK_T, BLOCK_S], dtype=tl.float32)
        q_rows = Q + b * s_qb + rows[:, None].to(tl.int64) * s_qt + offs_d[None, :]
        for j in range(Hi):
            q = tl.load(q_rows + j * s_qh, mask=mask_t[:, None] & mask_d[None, :], other=0.0)
            wj = tl.load(W + b * s_wb + rows.to(tl.int64) * s_wt + j, mask=mask_t, other=0.0).to(tl.float32)
            acc += tl.maximum(tl.dot(q, tl.trans(k)), 0.0) * wj[:, None]
        vis = (keys[None, :] <= rows[:, None]) & mask_t[:, None] & mask_s[None, :]
        if HAS_DOC:
            doc_t = tl.load(DOC + rows, mask=mask_t, other=-1)
            doc_s = tl.load(DOC + keys, mask=mask_s, other=-2)
            vis = vis & (doc_s[None, :] == doc_t[:, None])
        out = OUT + b * s_ob + (rows - t0)[:, None].to(tl.int64) * s_or + keys[None, :]
        tl.store(out, acc, mask=vis)


@torch.no_grad()
def indexer_topk_triton(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w: torch.Tensor,
    top_k: int,
    cu_seqlens: torch.Tensor | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """q_idx [B,T,Hi,Di], k_idx [B,T,Di], w [B,T,Hi] -> idx [B,T,top_k] int32, -1 padded (as the reference)."""
    if q_idx.dim() != 4 or k_idx.dim() != 3 or w.dim() != 3:
        raise ValueError("q_idx [B,T,Hi,Di], k_idx [B,T,Di], w [B,T,Hi] expected")
    B, T, Hi, Di = q_idx.shape
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens (packed documents) needs batch size 1, got B = {B}")
    q_idx, k_idx, w = q_idx.contiguous(), k_idx.to(q_idx.dtype).contiguous(), w.contiguous()
    doc = None if cu_seqlens is None else ref.document_ids(cu_seqlens.to(q_idx.device), T).to(torch.int32)
    DP = max(16, triton.next_power_of_2(Di))
    rows = max(1, min(T, chunk_bytes // (B * T * 4)))
    out = []
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        I = torch.full((B, t1 - t0, t1), float("-inf"), device=q_idx.device, dtype=torch.float32)

        def grid(meta, t0=t0, t1=t1):
            return (triton.cdiv(t1 - t0, meta["BLOCK_T"]), triton.cdiv(t1, meta["BLOCK_S"]), B)

        _indexer_scores_kernel[grid](
            q_idx, k_idx, w, doc if doc is not None else I, I,
            t0, t1, Hi,
            q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
            w.stride(0), w.stride(1), I.stride(0), I.stride(1),
            Di=Di, DP=DP, HAS_DOC=doc is not None,
        )  # fmt: skip
        out.append(ref.indexer_topk(I, top_k))
    return torch.cat(out, dim=1)
