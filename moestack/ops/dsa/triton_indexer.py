"""Lightning-indexer top-k (the "chunked" path: Triton block scoring + torch.topk over chunks of query rows; on a
GPU the default is triton_indexer_fused, see indexer_topk_triton) and the sparse-stage KL target (head-summed
attention probabilities over the selected keys) in Triton.

For a chunk of query rows [t0, t1) a Triton kernel writes the scores I[t, s] = sum_j w[t,j] ReLU(q[t,j] . k[s])
for keys s < t1 only (causal; -inf outside the document with cu_seqlens), tiles above the diagonal are skipped
and stay -inf; torch.topk then selects per row (reference.indexer_topk: order by descending score, -1 padded).
Only one chunk's [B, R, t1] fp32 block is ever held (CHUNK_BYTES), never T x T. The fused path holds no score
block at all; this one stays as the simple blockwise baseline and the CPU / interpreter default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestack.ops.dsa import reference as ref
from moestack.ops.dsa.triton_attn_fwd import INTERPRET
from moestack.ops.launch import pruner

CHUNK_BYTES = 1 << 30  # fp32 score block of one chunk of query rows
TOPK_MODES = ("auto", "chunked", "fused")


def _configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_T": 16, "BLOCK_S": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_T": bt, "BLOCK_S": bs}, num_warps=w, num_stages=s)
        for bt, bs, w, s in [(64, 128, 4, 3), (128, 128, 8, 3)]
    ]


@triton.autotune(configs=_configs(), key=["Hi", "DP"], restore_value=["OUT"],
                 prune_configs_by={"early_config_prune": pruner("indexer")})
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
    mode: str = "auto",
) -> torch.Tensor:
    """q_idx [B,T,Hi,Di], k_idx [B,T,Di], w [B,T,Hi] -> idx [B,T,top_k] int32, -1 padded (as the reference).

    mode "auto": "fused" on a GPU (triton_indexer_fused: sampled threshold + fused scoring with candidate
    compaction, no score block in memory; the same selected sets; H200, T = 32768: 12.9 ms with the Gluon candidate
    pass vs 20.3 ms for the chunked path, benchmarks/RESULTS.md DSA runs 5 and 9), "chunked" elsewhere (this
    function's block + torch.topk: in the Triton interpreter the fused path's two scoring passes cost more than
    they save). "chunked" / "fused" force one (tests, benchmarks)."""
    if mode not in TOPK_MODES:
        raise ValueError(f"indexer top-k mode '{mode}' is not one of {', '.join(TOPK_MODES)}")
    if mode == "auto":
        mode = "fused" if q_idx.is_cuda else "chunked"
    if mode == "fused":
        from moestack.ops.dsa.triton_indexer_fused import indexer_topk_fused

        return indexer_topk_fused(q_idx, k_idx, w, top_k, cu_seqlens=cu_seqlens)
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


def _target_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_H": 16, "BLOCK_K": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_H": 64, "BLOCK_K": 64}, num_warps=8, num_stages=2),
            triton.Config({"BLOCK_H": 32, "BLOCK_K": 64}, num_warps=4, num_stages=2)]  # fmt: skip


@triton.autotune(configs=_target_configs(), key=["H", "K", "VP", "RP"],
                 prune_configs_by={"early_config_prune": pruner("dsa_target")})
@triton.jit(do_not_specialize=["T", "H", "K"])
def _probs_target_kernel(
    Q, KV, IDX, LSE, P,
    T, H, K, scale_log2,
    s_qb, s_qt, s_qh, s_kb, s_ks, s_ib, s_it,
    V: tl.constexpr, R: tl.constexpr, VP: tl.constexpr, RP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """P[n, k] = sum_h exp(scale q[n,h] . kv[idx[n,k]] - lse[n,h]) for one (token, block of slots); 0 at -1."""
    n = tl.program_id(0).to(tl.int64)
    b = n // T
    t = n % T
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_c = tl.arange(0, VP)
    offs_r = tl.arange(0, RP)
    mask_c = offs_c < V
    mask_r = offs_r < R
    ids = tl.load(IDX + b * s_ib + t * s_it + offs_k, mask=offs_k < K, other=-1)
    valid = ids >= 0
    rows = KV + b * s_kb + tl.where(valid, ids, 0).to(tl.int64)[:, None] * s_ks
    k_c = tl.load(rows + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)
    k_r = tl.load(rows + V + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0)
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        q_rows = Q + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
        q_c = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
        q_r = tl.load(q_rows + V + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
        lse = tl.load(LSE + n * H + offs_h, mask=mask_h, other=0.0)
        lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
        s = tl.dot(q_c, tl.trans(k_c)) + tl.dot(q_r, tl.trans(k_r))
        p = tl.exp2(s * scale_log2 - lse2[:, None])
        acc += tl.sum(tl.where(mask_h[:, None] & valid[None, :], p, 0.0), 0)
    tl.store(P + n * K + offs_k, acc, mask=offs_k < K)


@torch.no_grad()
def attention_probs_target_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    scale: float,
    lse: torch.Tensor | None = None,
    idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """reference.attention_probs_target for the sparse stage (idx and the attention op's lse given): [B,T,K] fp32,
    the head-summed attention probabilities over the selected keys, L1-normalised, 0 at -1 slots. The dense
    warm-up target (idx None) is delegated to the reference."""
    if idx is None or lse is None:
        return ref.attention_probs_target(q, kv, scale, lse=lse, idx=idx, cu_seqlens=cu_seqlens)
    B, T, H, D = q.shape
    K = idx.shape[-1]
    V = min(D, 512)  # scores need no value split: any tiling of D works; 512 + 64 is MLA's
    VP, RP = max(16, triton.next_power_of_2(V)), max(16, triton.next_power_of_2(max(D - V, 1)))
    q, kv, idx, lse = q.contiguous(), kv.to(q.dtype).contiguous(), idx.to(torch.int32).contiguous(), lse.contiguous()
    p = torch.full((B, T, K), float("nan"), device=q.device, dtype=torch.float32)

    def grid(meta):
        return (B * T, triton.cdiv(K, meta["BLOCK_K"]))

    _probs_target_kernel[grid](
        q, kv, idx, lse.float(), p,
        T, H, K, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), idx.stride(0), idx.stride(1),
        V=V, R=D - V, VP=VP, RP=RP,
    )  # fmt: skip
    return p / p.sum(-1, keepdim=True)
