"""Sparse MQA attention backward in Triton: Delta precompute, dQ, and dKV by atomics or by a sorted scatter.

With P = softmax over a query's selected keys (rebuilt from the forward's lse), dP = dO V^T,
dS = P (dP - Delta) with Delta = rowsum(dO * O) - dlse (the lse gradient folds into Delta), then
dQ = scale dS K and, per selected row s, dKV[s] += scale dS^T Q (+ P^T dO on the value dims).
Many queries select the same key row, so dKV is a scatter-add. Selectable (`dkv_mode`):
  * "atomic": one fused kernel per (token, head block) computes dQ and adds its [BLOCK_K, D] dKV tiles into an
    fp32 buffer with relaxed fp32 atomics. The summation order (so the last bits) varies run to run; with
    H / BLOCK_H head blocks per token it issues that many atomics per (token, slot, dim).
  * "atomic_split": dQ from the same kernel without atomics; a second kernel per (token, block of slots) sums
    the contribution over all heads first, then one atomic per (token, slot, dim). Recomputes the scores and
    dP (+2 of the 5 products) to cut the atomic traffic by H / BLOCK_H.
  * "kmajor" (phase B): dQ from the same kernel without atomics (64-head blocks, wgmma); dKV from a key-major
    kernel, one program per (token, block of 64 slots) looping over head blocks: the tiles are computed transposed
    (S^T = K Q^T, dS^T, P^T: slots are the M dimension), so dS^T Q and P^T dO are wgmma products with no
    transpose in between, summed over all heads in registers, then one vectorised atomic per (token, slot, dim).
    Recomputes S and dP (7 products instead of 5) for half the atomics of "atomic" at 64 heads.
  * "sorted": deterministic. dQ comes from the same kernel without atomics; a second kernel, one program per
    (token, block of slots) looping over all head blocks, writes each (query, slot) contribution row to an fp32
    buffer (a chunk of queries at a time, so memory stays bounded); the chunk's (query, slot) pairs are sorted by
    key row and a segment-sum kernel adds each key's rows in that fixed order. Costs the scores twice and the
    buffer's write + read through HBM.
  * "kmajor_ds" (two passes, every product once): pass 1, one program per (token, block of slots), computes the
    key-major tiles of "kmajor" once, adds the dKV rows by vectorised atomics and stores dS (q dtype) to a
    [tokens, K, HP] buffer; pass 2 computes dQ = dS K per (token, head block): one product, no scores. Both run
    per chunk of tokens (DS_BUFFER_BYTES). TOKEN_TILE picks pass 1's work order.
  * "sorted_ds": deterministic "kmajor_ds": pass 1 writes the contribution rows (summed over head blocks in the
    program) for the sorted segment sum of "sorted" instead of the atomics.

Shape legend: B batch, T queries, S keys, H heads, D = V + R latent dims, K selected slots, N = B*T tokens.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moestack.ops.dsa.triton_attn_fwd import INTERPRET, LOG2E, _prune_head_blocks, autotune_off, padded_dims

TWO_PASS_MODES = ("kmajor_ds", "sorted_ds")  # pass 1 dKV + dS, pass 2 dQ from dS (no recomputed scores)
DKV_MODES = ("atomic", "atomic_split", "sorted", "kmajor", *TWO_PASS_MODES)
SORTED_BUFFER_BYTES = 4 * 2**30  # fp32 contribution rows held at once by the sorted scatter


def _bwd_configs(shapes):
    """(BLOCK_H, BLOCK_K, warps, stages) list -> configs; one config under the interpreter or MOESTACK_DSA_AUTOTUNE=0."""
    if INTERPRET:
        return [triton.Config({"BLOCK_H": 16, "BLOCK_K": 16}, num_warps=4, num_stages=1)]
    if autotune_off():
        shapes = shapes[:1]
    return [triton.Config({"BLOCK_H": bh, "BLOCK_K": bk}, num_warps=w, num_stages=s) for bh, bk, w, s in shapes]


# From an sm_90 compile (ptxas -v) of each: the dQ accumulator [BLOCK_H, 576] fp32 lives in registers, so wide
# head blocks spill; 64-head blocks fit (wgmma) only without the dKV atomics' extra tiles.
# Phase B: (64, 32, 8, 1) for the dQ-only kernel of kmajor / atomic_split / sorted (80 B of spills, 172 KB):
# wgmma, score tiles computed twice (see README) instead of four times with 32-head blocks; (32, 32, 8, 2) adds
# a pipelined gather (dQ-only: no spills, 106 KB; fused with atomics: 44 B of spills)
_BWD_SHAPES = [(32, 32, 8, 1), (32, 16, 8, 2), (64, 16, 8, 1), (16, 32, 4, 1), (64, 32, 8, 1), (32, 32, 8, 2)]
_ROWS_SHAPES = [(32, 32, 8, 1), (16, 32, 4, 2)]
# key-major dKV (BLOCK_H, BLOCK_K = slots, BLOCK_C = column chunk, COL_GROUPS, warps, stages): BLOCK_K = 16 * warps,
# so the score tiles (chained into the dKV products, which makes Triton put all warps on M) are not replicated.
# sm_90 ptxas, none spills: 242 / 235 registers, 64 / 88 KB shared memory (1 or 2 groups alike). Also clean, left
# out to keep autotuning short: (64, 64, 32, 1, 4, 2) 191 regs, (32, 64, 64, 1, 4, 3) 168 regs.
_KMAJOR_SHAPES = [(64, 64, 64, 1, 4, 2), (64, 128, 64, 1, 8, 2), (64, 64, 64, 2, 4, 2), (64, 128, 64, 2, 8, 2)]


def _kmajor_configs():
    if INTERPRET:  # two column groups: the tests cover the split
        cfg = {"BLOCK_H": 16, "BLOCK_K": 16, "BLOCK_C": 32, "COL_GROUPS": 2}
        return [triton.Config(cfg, num_warps=1, num_stages=1)]
    shapes = _KMAJOR_SHAPES[:1] if autotune_off() else _KMAJOR_SHAPES
    return [triton.Config({"BLOCK_H": bh, "BLOCK_K": bk, "BLOCK_C": bc, "COL_GROUPS": g}, num_warps=w, num_stages=s)
            for bh, bk, bc, g, w, s in shapes]  # fmt: skip


# Two-pass backward ("kmajor_ds" / "sorted_ds"). Pass 1, dKV + dS (BLOCK_H, BLOCK_K = slots, BLOCK_C, warps, stages):
# key-major tiles as kmajor with BLOCK_K = 16 * warps (the score tiles feed dots, so all warps sit on the slot axis:
# no replicated tile); 128 slots per program halve the re-reads of the token's Q and dO from L2 per slot.
# Pass 2, dQ = dS K (BLOCK_H, BLOCK_K, warps, stages): one product, no scores, so Triton splits the [64, 576] fp32
# accumulator over both warpgroups (N) and pipelines the gathers.
# The sixth entry caps registers per thread (Triton's maxnreg) so more programs share an SM and hide each other's
# waits (one program alternates wgmma, layout conversion and atomics): sm_90 ptxas, 64 heads: 128 slots x 8 warps
# takes 238 registers (1 program per SM) uncapped, 128 with 300 B of spills (2 per SM); 64 x 4 warps 240 (2 per
# SM) uncapped, 168 with 192 B of spills (3 per SM). Measured by the autotuner, not assumed.
_DKV_DS_SHAPES = [
    (64, 128, 64, 8, 2, None), (64, 128, 64, 8, 2, 128), (64, 64, 64, 4, 3, None), (64, 64, 64, 4, 2, 168),
    (32, 128, 64, 8, 2, None),
]  # fmt: skip
_DQ_DS_SHAPES = [(64, 32, 8, 3), (64, 64, 8, 2), (32, 64, 4, 3)]
DS_BUFFER_BYTES = 2 * 2**30  # dS [tokens, K, HP] (q dtype) held at once by the two-pass backward
DS_HEAD_PAD = 64  # HP = H rounded up to this: a multiple of every pass-1 / pass-2 BLOCK_H
# Pass-1 work order. 0: slot blocks of one token run together (the token's Q, dO shared in L2; the fp32 dKV rows hit
# anywhere in [0, t]: 75 MB of them at T = 32768, more than the L2). TOKEN_TILE > 0 (the default, env
# MOESTACK_DSA_BWD_TILE): each token's slots sorted by key row first (slot order is free: P, dS and the rows follow
# it), then tiles of TOKEN_TILE consecutive tokens with the slot block as the slower index inside the tile, so the
# programs running together add into one band of key rows (slot block j of a token ~ its j-th key quantile) and
# the tile's Q and dO (TOKEN_TILE x 136 KB at H = 64) stay in L2 across its slot blocks.
TOKEN_TILE = int(os.environ.get("MOESTACK_DSA_BWD_TILE", "64"))  # 64: 101 ms vs 125 ms for 0 (H200, T=32768, H=64)


def _dkv_ds_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_H": 16, "BLOCK_K": 16, "BLOCK_C": 32}, num_warps=1, num_stages=1)]
    shapes = _DKV_DS_SHAPES[:1] if autotune_off() else _DKV_DS_SHAPES
    return [triton.Config({"BLOCK_H": bh, "BLOCK_K": bk, "BLOCK_C": bc}, num_warps=w, num_stages=s, maxnreg=r)
            for bh, bk, bc, w, s, r in shapes]  # fmt: skip


def _prune_dkv_ds(configs, named_args, **kwargs):
    """As _prune_head_blocks; fewer compiles for the variants off the main path: the deterministic rows output
    (sorted_ds) tunes over the first two configs, the banded order (TOKEN_TILE > 0) over the first three."""
    kept = _prune_head_blocks(configs, named_args, **kwargs)
    if kwargs.get("DKV_OUT") == "rows":
        return kept[:2]
    return kept[:3] if kwargs.get("TOKEN_TILE", 0) > 0 else kept


def _prune_bwd(configs, named_args, **kwargs):
    """As _prune_head_blocks; with ATOMIC also drop 64-head blocks (over 227 KB of shared memory on sm_90)."""
    kept = _prune_head_blocks(configs, named_args, **kwargs)
    if kwargs.get("ATOMIC", False):
        kept = [c for c in kept if c.kwargs["BLOCK_H"] < 64] or kept[:1]
    return kept


@triton.jit
def _delta_kernel(
    O, DO, DLSE, DELTA, H, s_on, s_oh, HAS_DLSE: tl.constexpr, V: tl.constexpr, VP: tl.constexpr, BLOCK_H: tl.constexpr
):  # fmt: skip
    """Delta[n, h] = sum_v dO[n,h,v] O[n,h,v] - dlse[n,h]  (o, do [N,H,V] with the same strides; dlse, delta [N,H])."""
    n = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_v = tl.arange(0, VP)
    offs = n.to(tl.int64) * s_on + offs_h[:, None] * s_oh + offs_v[None, :]
    mask = mask_h[:, None] & (offs_v < V)[None, :]
    o = tl.load(O + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + n.to(tl.int64) * H + offs_h, mask=mask_h, other=0.0)
    tl.store(DELTA + n.to(tl.int64) * H + offs_h, delta, mask=mask_h)


@triton.jit
def _scores_and_ds(q_c, q_r, do, lse2, delta, k_c, k_r, valid, mask_h, scale_log2):
    """P [BH,BK] and dS = P (dP - Delta), the gradient of the logit scale * q.k, of one tile (masked -> 0)."""
    s = tl.dot(q_c, tl.trans(k_c)) + tl.dot(q_r, tl.trans(k_r))
    p = tl.exp2(s * scale_log2 - lse2[:, None])
    p = tl.where(valid[None, :] & mask_h[:, None], p, 0.0)
    dp = tl.dot(do, tl.trans(k_c))
    ds = p * (dp - delta[:, None])
    return p, ds


@triton.autotune(
    configs=_bwd_configs(_BWD_SHAPES),
    key=["H", "K", "V", "R", "ATOMIC"],
    prune_configs_by={"early_config_prune": _prune_bwd},
    reset_to_zero=["DKV"],
)
@triton.jit(do_not_specialize=["T", "H", "K"])
def _sparse_mqa_bwd_kernel(
    Q, KV, IDX, DO, LSE, DELTA, DQ, DKV,
    T, H, K, scale, scale_log2,
    s_qb, s_qt, s_qh,
    s_kb, s_ks,
    s_ib, s_it,
    s_ob, s_ot, s_oh,
    s_dkb, s_dks,
    V: tl.constexpr, R: tl.constexpr, VP: tl.constexpr, RP: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program per (token, head block): dQ in registers over all slots; with ATOMIC, dKV tiles by atomics."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = (pid_t // T).to(tl.int64)
    t = (pid_t % T).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_c = tl.arange(0, VP)
    offs_r = tl.arange(0, RP)
    mask_c = offs_c < V
    mask_r = offs_r < R

    q_rows = Q + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
    q_c = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q_rows + V + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    do_ptrs = DO + b * s_ob + t * s_ot + offs_h[:, None] * s_oh + offs_c[None, :]
    do = tl.load(do_ptrs, mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    n = pid_t.to(tl.int64)
    lse = tl.load(LSE + n * H + offs_h, mask=mask_h, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    delta = tl.load(DELTA + n * H + offs_h, mask=mask_h, other=0.0)
    kv_base = KV + b * s_kb
    dkv_base = DKV + b * s_dkb
    idx_base = IDX + b * s_ib + t * s_it

    dq_c = tl.zeros([BLOCK_H, VP], dtype=tl.float32)
    dq_r = tl.zeros([BLOCK_H, RP], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ids = tl.load(idx_base + offs_k, mask=offs_k < K, other=-1)
        valid = ids >= 0
        row = tl.where(valid, ids, 0).to(tl.int64)
        k_c = tl.load(kv_base + row[:, None] * s_ks + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)
        k_r = tl.load(
            kv_base + row[:, None] * s_ks + V + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0
        )
        p, ds = _scores_and_ds(q_c, q_r, do, lse2, delta, k_c, k_r, valid, mask_h, scale_log2)
        ds = (ds * scale).to(q_c.dtype)
        dq_c += tl.dot(ds, k_c)
        dq_r += tl.dot(ds, k_r)
        if ATOMIC:
            dk_c = tl.dot(tl.trans(ds), q_c) + tl.dot(tl.trans(p.to(do.dtype)), do)  # [BK, V]
            dk_r = tl.dot(tl.trans(ds), q_r)
            dst = dkv_base + row[:, None] * s_dks
            tl.atomic_add(dst + offs_c[None, :], dk_c, mask=valid[:, None] & mask_c[None, :], sem="relaxed")
            if R > 0:
                tl.atomic_add(dst + V + offs_r[None, :], dk_r, mask=valid[:, None] & mask_r[None, :], sem="relaxed")

    dq_rows = DQ + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
    tl.store(dq_rows + offs_c[None, :], dq_c.to(DQ.dtype.element_ty), mask=mask_h[:, None] & mask_c[None, :])
    tl.store(dq_rows + V + offs_r[None, :], dq_r.to(DQ.dtype.element_ty), mask=mask_h[:, None] & mask_r[None, :])


@triton.autotune(
    configs=_bwd_configs(_ROWS_SHAPES),
    key=["H", "K", "V", "R", "ATOMIC"],
    prune_configs_by={"early_config_prune": _prune_head_blocks},
    reset_to_zero=["DKV"],
)
@triton.jit(do_not_specialize=["n0", "T", "H", "K"])
def _sparse_mqa_dkv_rows_kernel(
    Q, KV, IDX, DO, LSE, DELTA, BUF, DKV,
    n0, T, H, K, scale, scale_log2,
    s_qb, s_qt, s_qh,
    s_kb, s_ks,
    s_ib, s_it,
    s_ob, s_ot, s_oh,
    s_dkb, s_dks,
    V: tl.constexpr, R: tl.constexpr, VP: tl.constexpr, RP: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program per (token n0 + i, block of slots): that block's dKV contribution rows summed over all heads.
    ATOMIC: added into DKV[b, idx] (fp32) with one atomic per element and (token, slot), whatever H is;
    else written to BUF[i, slot, :] (fp32 [chunk, K, D]) for the sorted scatter."""
    i = tl.program_id(0)
    pid_t = n0 + i
    b = (pid_t // T).to(tl.int64)
    t = (pid_t % T).to(tl.int64)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_c = tl.arange(0, VP)
    offs_r = tl.arange(0, RP)
    mask_c = offs_c < V
    mask_r = offs_r < R
    ids = tl.load(IDX + b * s_ib + t * s_it + offs_k, mask=offs_k < K, other=-1)
    valid = ids >= 0
    row = tl.where(valid, ids, 0).to(tl.int64)
    kv_rows = KV + b * s_kb + row[:, None] * s_ks
    k_c = tl.load(kv_rows + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)
    k_r = tl.load(kv_rows + V + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0)
    n = pid_t.to(tl.int64)

    dk_c = tl.zeros([BLOCK_K, VP], dtype=tl.float32)
    dk_r = tl.zeros([BLOCK_K, RP], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        q_rows = Q + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
        q_c = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
        q_r = tl.load(q_rows + V + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
        do_ptrs = DO + b * s_ob + t * s_ot + offs_h[:, None] * s_oh + offs_c[None, :]
        do = tl.load(do_ptrs, mask=mask_h[:, None] & mask_c[None, :], other=0.0)
        lse = tl.load(LSE + n * H + offs_h, mask=mask_h, other=0.0)
        lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
        delta = tl.load(DELTA + n * H + offs_h, mask=mask_h, other=0.0)
        p, ds = _scores_and_ds(q_c, q_r, do, lse2, delta, k_c, k_r, valid, mask_h, scale_log2)
        ds = (ds * scale).to(q_c.dtype)
        dk_c += tl.dot(tl.trans(ds), q_c) + tl.dot(tl.trans(p.to(do.dtype)), do)
        dk_r += tl.dot(tl.trans(ds), q_r)

    if ATOMIC:
        dst = DKV + b * s_dkb + row[:, None] * s_dks
        tl.atomic_add(dst + offs_c[None, :], dk_c, mask=valid[:, None] & mask_c[None, :], sem="relaxed")
        if R > 0:
            tl.atomic_add(dst + V + offs_r[None, :], dk_r, mask=valid[:, None] & mask_r[None, :], sem="relaxed")
    else:
        dst = BUF + (i.to(tl.int64) * K + offs_k[:, None]) * (V + R)
        tl.store(dst + offs_c[None, :], dk_c, mask=(offs_k < K)[:, None] & mask_c[None, :])
        tl.store(dst + V + offs_r[None, :], dk_r, mask=(offs_k < K)[:, None] & mask_r[None, :])


@triton.autotune(
    configs=_kmajor_configs(),
    key=["H", "K", "V", "R"],
    prune_configs_by={"early_config_prune": _prune_head_blocks},
    reset_to_zero=["DKV"],
)
@triton.jit(do_not_specialize=["T", "H", "K"])
def _sparse_mqa_dkv_kmajor_kernel(
    Q, KV, IDX, DO, LSE, DELTA, DKV,
    T, H, K, scale, scale_log2,
    s_qb, s_qt, s_qh,
    s_kb, s_ks,
    s_ib, s_it,
    s_ob, s_ot, s_oh,
    s_dkb, s_dks,
    V: tl.constexpr, R: tl.constexpr, VP: tl.constexpr, RP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, COL_GROUPS: tl.constexpr,
):  # fmt: skip
    """One program per (token, block of BLOCK_K slots, group of dKV columns), heads in blocks of BLOCK_H:
    key-major tiles S^T = K Q^T [BLOCK_K, BLOCK_H] (slots are the M dimension, BLOCK_K = 16 * num_warps: no warp computes a
    replica of the tile), then dKV rows dS^T Q + P^T dO by column chunks of BLOCK_C, each added into DKV[b, idx]
    (fp32) with one vectorised atomic per element at once (nothing [BLOCK_K, 576]-sized is held in registers).
    Every operand is a small tile streamed from L2 through the pipelined chunk loops. COL_GROUPS > 1 splits the
    dKV columns over that many programs (grid axis 2, launched group after group), each recomputing the scores:
    the fp32 dKV buffer (T x 576 x 4 B = 75 MB at T = 32768) is larger than the L2, the atomics of one group
    touch 1 / COL_GROUPS of it."""
    pid_t = tl.program_id(0)
    b = (pid_t // T).to(tl.int64)
    t = (pid_t % T).to(tl.int64)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    group = tl.program_id(2)
    c_lo = group * (VP // COL_GROUPS)
    c_hi = c_lo + VP // COL_GROUPS
    offs_cc = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, RP)
    mask_r = offs_r < R
    ids = tl.load(IDX + b * s_ib + t * s_it + offs_k, mask=offs_k < K, other=-1)
    valid = ids >= 0
    row = tl.where(valid, ids, 0).to(tl.int64)
    kv_rows = KV + b * s_kb + row[:, None] * s_ks
    dst_rows = DKV + b * s_dkb + row[:, None] * s_dks
    n = pid_t.to(tl.int64)
    k_r = tl.load(kv_rows + V + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0)  # [BK, RP]

    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        q_rows = Q + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
        do_rows = DO + b * s_ob + t * s_ot + offs_h[:, None] * s_oh
        # scores and dP, contraction over the value dims in chunks (+ the rope part for the scores)
        q_r = tl.load(q_rows + V + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
        s_t = tl.dot(k_r, tl.trans(q_r))  # [BK, BH]
        dp_t = tl.zeros([BLOCK_K, BLOCK_H], dtype=tl.float32)
        for c0 in range(0, VP, BLOCK_C):
            offs_c = c0 + offs_cc
            mask_c = offs_c < V
            k_c = tl.load(kv_rows + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)
            q_c = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
            do_c = tl.load(do_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
            s_t = tl.dot(k_c, tl.trans(q_c), s_t)
            dp_t = tl.dot(k_c, tl.trans(do_c), dp_t)
        lse = tl.load(LSE + n * H + offs_h, mask=mask_h, other=0.0)
        lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
        delta = tl.load(DELTA + n * H + offs_h, mask=mask_h, other=0.0)
        p_t = tl.exp2(s_t * scale_log2 - lse2[None, :])
        p_t = tl.where(valid[:, None] & mask_h[None, :], p_t, 0.0)
        ds_t = (p_t * (dp_t - delta[None, :]) * scale).to(q_r.dtype)
        p_t = p_t.to(q_r.dtype)
        # dKV rows of this head block, chunk by chunk straight into the fp32 buffer
        if R > 0 and group == COL_GROUPS - 1:  # the rope columns go with the last group
            dk_r = tl.dot(ds_t, q_r)
            tl.atomic_add(dst_rows + V + offs_r[None, :], dk_r, mask=valid[:, None] & mask_r[None, :], sem="relaxed")
        for c0 in range(c_lo, c_hi, BLOCK_C):
            offs_c = c0 + offs_cc
            mask_c = (offs_c < V) & (offs_c < c_hi)  # a group narrower than BLOCK_C stays inside its columns
            q_c = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
            do_c = tl.load(do_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
            dk_c = tl.dot(p_t, do_c, tl.dot(ds_t, q_c))  # [BK, BC]
            tl.atomic_add(dst_rows + offs_c[None, :], dk_c, mask=valid[:, None] & mask_c[None, :], sem="relaxed")


@triton.jit
def _add_rows(ptrs, x, mask, DKV_OUT: tl.constexpr, accumulate):
    """x into fp32 rows: relaxed atomics ("atomic"); stored, added to what is there if accumulate ("rows");
    "none" (timing only): a store of x's elements above 3e38 alone (none in practice), so x is still computed
    and re-laid out for the store, but no memory traffic."""
    if DKV_OUT == "rows":
        if accumulate:
            x += tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, x, mask=mask)
    elif DKV_OUT == "atomic":
        tl.atomic_add(ptrs, x, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, x, mask=mask & (x > 3.0e38))


@triton.autotune(
    configs=_dkv_ds_configs(),
    key=["H", "K", "V", "R", "DKV_OUT", "TOKEN_TILE"],
    prune_configs_by={"early_config_prune": _prune_dkv_ds},
    reset_to_zero=["DKV"],
)
@triton.jit(do_not_specialize=["n0", "n", "T", "H", "K"])
def _sparse_mqa_bwd_kernel_dkv(
    Q, KV, IDX, DO, LSE, DELTA, DKV, DS,
    n0, n, T, H, K, HP, scale, scale_log2,
    s_qb, s_qt, s_qh,
    s_kb, s_ks,
    s_ib, s_it,
    s_ob, s_ot, s_oh,
    s_dkb, s_dks,
    V: tl.constexpr, R: tl.constexpr, VP: tl.constexpr, RP: tl.constexpr, DKV_OUT: tl.constexpr,
    TOKEN_TILE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Pass 1 of the two-pass backward. One program per (token n0 + i, i < n, block of BLOCK_K slots), in the
    order TOKEN_TILE says (module constant of that name; programs past the last token do nothing). Heads in blocks of
    BLOCK_H: key-major S^T = K Q^T, dP^T = V dO^T [BLOCK_K, BLOCK_H] (contractions streamed in BLOCK_C chunks),
    P^T, dS^T; dS^T (scaled, q dtype) is stored to DS[i] [K, HP] for pass 2 (dQ = dS K; HP = H padded to a
    multiple of BLOCK_H: the stores carry no head mask, so they vectorise; padded heads get 0), and the dKV rows
    dS^T Q + P^T dO go out in BLOCK_C-column chunks: DKV_OUT "atomic", relaxed fp32 atomics into DKV[b, idx]
    (one per element and head block); "rows", written to DKV = BUF[i] [K, D] fp32 (summed over head blocks by
    this program) for the sorted scatter; "none", computed but not written (benchmarks/dsa.py: the atomics'
    share of the pass)."""
    pid = tl.program_id(0)
    n_kb = tl.cdiv(K, BLOCK_K)
    if TOKEN_TILE == 0:
        i = pid // n_kb
        kb = pid % n_kb
    else:
        kb = (pid % (TOKEN_TILE * n_kb)) // TOKEN_TILE
        i = (pid // (TOKEN_TILE * n_kb)) * TOKEN_TILE + pid % TOKEN_TILE
    live = i < n  # a partial last tile: those programs read token n - 1 and write nothing
    i = tl.minimum(i, n - 1)
    pid_t = n0 + i
    b = (pid_t // T).to(tl.int64)
    t = (pid_t % T).to(tl.int64)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = (offs_k < K) & live
    offs_cc = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, RP)
    mask_r = offs_r < R
    ids = tl.load(IDX + b * s_ib + t * s_it + offs_k, mask=mask_k, other=-1)
    valid = ids >= 0
    row = tl.where(valid, ids, 0).to(tl.int64)
    kv_rows = KV + b * s_kb + row[:, None] * s_ks
    slot_rows = i.to(tl.int64) * K + offs_k[:, None]  # [BK, 1] rows of this chunk's [n, K, *] buffers
    if DKV_OUT == "rows":
        dst_rows = DKV + slot_rows * (V + R)
        mask_dst = mask_k
    else:
        dst_rows = DKV + b * s_dkb + row[:, None] * s_dks
        mask_dst = valid
    n = pid_t.to(tl.int64)
    k_r = tl.load(kv_rows + V + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0)  # [BK, RP]

    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        q_rows = Q + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
        do_rows = DO + b * s_ob + t * s_ot + offs_h[:, None] * s_oh
        q_r = tl.load(q_rows + V + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
        s_t = tl.dot(k_r, tl.trans(q_r))  # [BK, BH]
        dp_t = tl.zeros([BLOCK_K, BLOCK_H], dtype=tl.float32)
        for c0 in range(0, VP, BLOCK_C):
            offs_c = c0 + offs_cc
            mask_c = offs_c < V
            k_c = tl.load(kv_rows + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)
            q_c = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
            do_c = tl.load(do_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
            s_t = tl.dot(k_c, tl.trans(q_c), s_t)
            dp_t = tl.dot(k_c, tl.trans(do_c), dp_t)
        lse = tl.load(LSE + n * H + offs_h, mask=mask_h, other=0.0)
        lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
        delta = tl.load(DELTA + n * H + offs_h, mask=mask_h, other=0.0)
        p_t = tl.exp2(s_t * scale_log2 - lse2[None, :])
        p_t = tl.where(valid[:, None] & mask_h[None, :], p_t, 0.0)
        ds_t = (p_t * (dp_t - delta[None, :]) * scale).to(q_r.dtype)  # [BK, BH]
        p_t = p_t.to(q_r.dtype)
        tl.store(DS + slot_rows * HP + offs_h[None, :], ds_t, mask=mask_k[:, None])
        if DKV_OUT == "rows":
            tl.debug_barrier()  # rows written by other threads of this program for the previous head block
        if R > 0:
            dk_r = tl.dot(ds_t, q_r)
            _add_rows(dst_rows + V + offs_r[None, :], dk_r, mask_dst[:, None] & mask_r[None, :], DKV_OUT, h0 > 0)
        for c0 in range(0, VP, BLOCK_C):
            offs_c = c0 + offs_cc
            mask_c = offs_c < V
            q_c = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
            do_c = tl.load(do_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
            dk_c = tl.dot(p_t, do_c, tl.dot(ds_t, q_c))  # [BK, BC]
            _add_rows(dst_rows + offs_c[None, :], dk_c, mask_dst[:, None] & mask_c[None, :], DKV_OUT, h0 > 0)


@triton.autotune(
    configs=_bwd_configs(_DQ_DS_SHAPES),
    key=["H", "K", "V", "R"],
    prune_configs_by={"early_config_prune": _prune_head_blocks},
)
@triton.jit(do_not_specialize=["n0", "T", "H", "K"])
def _sparse_mqa_bwd_kernel_dq(
    KV, IDX, DS, DQ,
    n0, T, H, K, HP,
    s_qb, s_qt, s_qh,
    s_kb, s_ks,
    s_ib, s_it,
    V: tl.constexpr, R: tl.constexpr, VP: tl.constexpr, RP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Pass 2: dQ [BLOCK_H, D] = dS K for token n0 + i and a head block, dS read from DS[i] [K, HP] (scaled by
    pass 1), the selected latent rows gathered BLOCK_K at a time. One product per slot block, no scores. The dS
    loads carry no head mask (they vectorise): a padded head's row is never stored, and a dQ row depends only on
    its own dS row."""
    i = tl.program_id(0)
    pid_t = n0 + i
    b = (pid_t // T).to(tl.int64)
    t = (pid_t % T).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_c = tl.arange(0, VP)
    offs_r = tl.arange(0, RP)
    mask_c = offs_c < V
    mask_r = offs_r < R
    kv_base = KV + b * s_kb
    idx_base = IDX + b * s_ib + t * s_it
    ds_base = DS + i.to(tl.int64) * K * HP + offs_h[:, None]

    dq_c = tl.zeros([BLOCK_H, VP], dtype=tl.float32)
    dq_r = tl.zeros([BLOCK_H, RP], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        ids = tl.load(idx_base + offs_k, mask=mask_k, other=-1)
        valid = ids >= 0
        row = tl.where(valid, ids, 0).to(tl.int64)
        k_c = tl.load(kv_base + row[:, None] * s_ks + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)
        k_r = tl.load(
            kv_base + row[:, None] * s_ks + V + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0
        )
        ds = tl.load(ds_base + offs_k[None, :] * HP, mask=mask_k[None, :], other=0.0)  # [BH, BK]
        dq_c = tl.dot(ds, k_c, dq_c)
        dq_r = tl.dot(ds, k_r, dq_r)

    dq_rows = DQ + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
    tl.store(dq_rows + offs_c[None, :], dq_c.to(DQ.dtype.element_ty), mask=mask_h[:, None] & mask_c[None, :])
    tl.store(dq_rows + V + offs_r[None, :], dq_r.to(DQ.dtype.element_ty), mask=mask_h[:, None] & mask_r[None, :])


@triton.jit
def _segment_sum_kernel(
    BUF, ORDER, KEYS, STARTS, DKV, D: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr
):  # fmt: skip
    """DKV[key] += sum of BUF rows ORDER[STARTS[u] : STARTS[u+1]] for unique key u, in that (sorted) order."""
    u = tl.program_id(0)
    key = tl.load(KEYS + u)
    if key >= 0:
        start = tl.load(STARTS + u)
        end = tl.load(STARTS + u + 1)
        for d0 in tl.static_range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for j0 in range(start, end, BLOCK_J):
                offs_j = j0 + tl.arange(0, BLOCK_J)
                rows = tl.load(ORDER + offs_j, mask=offs_j < end, other=0)
                x = tl.load(
                    BUF + rows[:, None] * D + offs_d[None, :], mask=(offs_j < end)[:, None] & mask_d[None, :], other=0.0
                )
                acc += tl.sum(x, 0)
            dst = DKV + key.to(tl.int64) * D + offs_d
            tl.store(dst, tl.load(dst, mask=mask_d) + acc, mask=mask_d)


def attention_delta(o: torch.Tensor, do: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """Delta [B,T,H] fp32 = rowsum(dO * O) - dlse, for o, do [B,T,H,V] (same layout)."""
    B, T, H, V = o.shape
    o, do = o.contiguous(), do.contiguous()
    delta = torch.empty((B, T, H), device=o.device, dtype=torch.float32)
    dlse_ = delta if dlse is None else dlse.float().contiguous()
    bh = 16
    _delta_kernel[(B * T, triton.cdiv(H, bh))](
        o,
        do,
        dlse_,
        delta,
        H,
        o.stride(1),
        o.stride(2),
        HAS_DLSE=dlse is not None,
        V=V,
        VP=padded_dims(V, 0)[0],
        BLOCK_H=bh,
    )
    return delta


def _dkv_rows(q, kv, idx, do, lse, delta, scale, buf, dkv32, n0, n):
    """_sparse_mqa_dkv_rows_kernel over tokens [n0, n0 + n): atomics into dkv32 when buf is None, else rows to buf."""
    T, H, D = q.shape[1], q.shape[2], q.shape[3]
    K, V = idx.shape[-1], do.shape[-1]
    VP, RP = padded_dims(V, D - V)

    def grid(meta):
        return (n, triton.cdiv(K, meta["BLOCK_K"]))

    _sparse_mqa_dkv_rows_kernel[grid](
        q, kv, idx, do, lse, delta, dkv32 if buf is None else buf, dkv32,
        n0, T, H, K, scale, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        idx.stride(0), idx.stride(1),
        do.stride(0), do.stride(1), do.stride(2),
        dkv32.stride(0), dkv32.stride(1),
        V=V, R=D - V, VP=VP, RP=RP, ATOMIC=buf is None,
    )  # fmt: skip


def _dkv_kmajor(q, kv, idx, do, lse, delta, scale, dkv32):
    """_sparse_mqa_dkv_kmajor_kernel over all tokens: atomics into dkv32."""
    B, T, H, D = q.shape
    K, V = idx.shape[-1], do.shape[-1]
    VP, RP = padded_dims(V, D - V)

    def grid(meta):
        return (B * T, triton.cdiv(K, meta["BLOCK_K"]), meta["COL_GROUPS"])

    _sparse_mqa_dkv_kmajor_kernel[grid](
        q, kv, idx, do, lse, delta, dkv32,
        T, H, K, scale, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        idx.stride(0), idx.stride(1),
        do.stride(0), do.stride(1), do.stride(2),
        dkv32.stride(0), dkv32.stride(1),
        V=V, R=D - V, VP=VP, RP=RP,
    )  # fmt: skip


def _dkv_ds_pass(q, kv, idx, do, lse, delta, scale, dst, ds, n0, n, out):
    """Pass 1 over tokens [n0, n0 + n): dS into ds [n, K, HP]; dKV by atomics into dst = dkv32 [B, S, D] fp32
    (out "atomic"), or the contribution rows into dst = buf [>= n, K, D] fp32 ("rows"), or nowhere ("none")."""
    T, H, D = q.shape[1], q.shape[2], q.shape[3]
    K, V = idx.shape[-1], do.shape[-1]
    VP, RP = padded_dims(V, D - V)

    tile = TOKEN_TILE

    def grid(meta):
        return ((n if tile == 0 else triton.cdiv(n, tile) * tile) * triton.cdiv(K, meta["BLOCK_K"]),)

    _sparse_mqa_bwd_kernel_dkv[grid](
        q, kv, idx, do, lse, delta, dst, ds,
        n0, n, T, H, K, ds.shape[-1], scale, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        idx.stride(0), idx.stride(1),
        do.stride(0), do.stride(1), do.stride(2),
        dst.stride(0), dst.stride(1),
        V=V, R=D - V, VP=VP, RP=RP, DKV_OUT=out, TOKEN_TILE=tile,
    )  # fmt: skip


def _dq_ds_pass(kv, idx, ds, dq, n0, n, V):
    """Pass 2 over tokens [n0, n0 + n): dq [B,T,H,D] rows of those tokens = dS K, dS from ds [n, K, HP]."""
    T, H, D = dq.shape[1], dq.shape[2], dq.shape[3]
    K = idx.shape[-1]
    VP, RP = padded_dims(V, D - V)

    def grid(meta):
        return (n, triton.cdiv(H, meta["BLOCK_H"]))

    _sparse_mqa_bwd_kernel_dq[grid](
        kv, idx, ds, dq,
        n0, T, H, K, ds.shape[-1],
        dq.stride(0), dq.stride(1), dq.stride(2),
        kv.stride(0), kv.stride(1),
        idx.stride(0), idx.stride(1),
        V=V, R=D - V, VP=VP, RP=RP,
    )  # fmt: skip


def _two_pass_bwd(q, kv, idx, do, lse, delta, scale, dq, dkv32, deterministic, ds_bytes, sorted_bytes):
    """dq and dkv32 by pass 1 (dKV + dS) and pass 2 (dQ from dS) over chunks of tokens; deterministic: pass 1
    writes contribution rows and the sorted scatter adds them (chunks also bounded by the sorted buffer)."""
    B, T, H, D = q.shape
    K, V = idx.shape[-1], do.shape[-1]
    N = B * T
    if TOKEN_TILE > 0:  # slots in key order (see TOKEN_TILE); -1 slots first
        idx = torch.sort(idx, dim=-1).values.contiguous()
    HP = triton.cdiv(H, DS_HEAD_PAD) * DS_HEAD_PAD
    chunk = max(1, min(N, ds_bytes // (K * HP * q.element_size())))
    if deterministic:
        chunk = min(chunk, max(1, sorted_bytes // (K * D * 4)))
    ds = torch.empty((chunk, K, HP), device=q.device, dtype=q.dtype)

    def passes(dst, n0, n):
        _dkv_ds_pass(q, kv, idx, do, lse, delta, scale, dst, ds, n0, n, "rows" if deterministic else "atomic")
        _dq_ds_pass(kv, idx, ds, dq, n0, n, V)

    if deterministic:
        _sorted_scatter_dkv(q, kv, idx, dkv32, chunk, passes)
    else:
        for n0 in range(0, N, chunk):
            passes(dkv32, n0, min(chunk, N - n0))


def _sorted_scatter_dkv(q, kv, idx, dkv32, chunk, fill_rows):
    """dKV by the deterministic sorted scatter over chunks of `chunk` tokens (see module docstring);
    fill_rows(buf, n0, n) writes the contribution rows of tokens [n0, n0 + n) into buf[:n] [n, K, D] fp32."""
    B, T, _, D = q.shape
    S, K = kv.shape[1], idx.shape[-1]
    N = B * T
    buf = torch.empty((chunk, K, D), device=q.device, dtype=torch.float32)
    # global key row of every (token, slot): b * S + idx, or -1
    batch_off = (torch.arange(B, device=q.device, dtype=torch.int64) * S)[:, None, None]
    keys_all = torch.where(idx >= 0, idx.long() + batch_off, -1).view(N, K)
    dkv_flat = dkv32.view(B * S, D)
    for n0 in range(0, N, chunk):
        n = min(chunk, N - n0)
        fill_rows(buf, n0, n)
        keys_sorted, order = torch.sort(keys_all[n0 : n0 + n].reshape(-1), stable=True)
        uniq, counts = torch.unique_consecutive(keys_sorted, return_counts=True)
        starts = torch.zeros(uniq.numel() + 1, device=q.device, dtype=torch.int64)
        starts[1:] = torch.cumsum(counts, 0)
        _segment_sum_kernel[(uniq.numel(),)](buf, order, uniq, starts, dkv_flat, D=D, BLOCK_J=16, BLOCK_D=128)


def sparse_mqa_bwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    scale: float,
    dkv_mode: str = "atomic",
    sorted_buffer_bytes: int = SORTED_BUFFER_BYTES,
    ds_buffer_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (dq [B,T,H,D] q.dtype, dkv [B,S,D] kv.dtype) of sparse_mqa_fwd's outputs."""
    if dkv_mode not in DKV_MODES:
        raise ValueError(f"dkv_mode '{dkv_mode}' is not one of {DKV_MODES}")
    B, T, H, D = q.shape
    K, V = idx.shape[-1], o.shape[-1]
    q, kv, do = q.contiguous(), kv.contiguous(), do.contiguous()
    idx = idx.to(torch.int32).contiguous()
    lse = lse.contiguous()
    delta = attention_delta(o, do, dlse)
    dq = torch.full_like(q, float("nan"))
    dkv32 = torch.zeros(kv.shape, device=kv.device, dtype=torch.float32)
    if dkv_mode in TWO_PASS_MODES:
        ds_bytes = DS_BUFFER_BYTES if ds_buffer_bytes is None else ds_buffer_bytes
        deterministic = dkv_mode == "sorted_ds"
        _two_pass_bwd(q, kv, idx, do, lse, delta, scale, dq, dkv32, deterministic, ds_bytes, sorted_buffer_bytes)
        return dq, dkv32.to(kv.dtype)
    atomic = dkv_mode == "atomic"
    VP, RP = padded_dims(V, D - V)

    def grid(meta):
        return (B * T, triton.cdiv(H, meta["BLOCK_H"]))

    _sparse_mqa_bwd_kernel[grid](
        q, kv, idx, do, lse, delta, dq, dkv32,
        T, H, K, scale, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        idx.stride(0), idx.stride(1),
        do.stride(0), do.stride(1), do.stride(2),
        dkv32.stride(0), dkv32.stride(1),
        V=V, R=D - V, VP=VP, RP=RP, ATOMIC=atomic,
    )  # fmt: skip
    if dkv_mode == "atomic_split":
        _dkv_rows(q, kv, idx, do, lse, delta, scale, None, dkv32, 0, B * T)
    elif dkv_mode == "kmajor":
        _dkv_kmajor(q, kv, idx, do, lse, delta, scale, dkv32)
    elif dkv_mode == "sorted":
        chunk = max(1, min(B * T, sorted_buffer_bytes // (K * D * 4)))

        def fill_rows(buf, n0, n):
            _dkv_rows(q, kv, idx, do, lse, delta, scale, buf, dkv32, n0, n)

        _sorted_scatter_dkv(q, kv, idx, dkv32, chunk, fill_rows)
    return dq, dkv32.to(kv.dtype)
