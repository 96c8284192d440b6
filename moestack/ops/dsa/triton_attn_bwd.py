"""Sparse MQA attention backward in Triton: Delta precompute, then two passes over the selected slots.

With P = softmax over a query's selected keys (rebuilt from the forward's lse), dP = dO V^T,
dS = P (dP - Delta) with Delta = rowsum(dO * O) - dlse (the lse gradient folds into Delta), then
dQ = scale dS K and, per selected row s, dKV[s] += scale dS^T Q (+ P^T dO on the value dims).
Many queries select the same key row, so dKV is a scatter-add. Every product is computed once:
  pass 1, one program per (token, block of slots): key-major tiles (S^T = K Q^T, dS^T, P^T: slots are the M
  dimension, so dS^T Q and P^T dO are wgmma products with no transpose), dKV rows added into an fp32 buffer, and
  dS (q dtype) stored to a [tokens, K, HP] buffer; pass 2, one program per (token, head block): dQ = dS K, one
  product, no scores. Both run per chunk of tokens (DS_BUFFER_BYTES). Two forms of pass 1's dKV (`dkv_mode`):
  * "kmajor_ds" (default): vectorised relaxed fp32 atomics (the summation order, so the last bits, vary run to
    run); pass 1's work order is tiled by TOKEN_TILE tokens (below).
  * "sorted_ds" (chosen under torch.use_deterministic_algorithms): pass 1 writes each (query, slot) contribution
    row (summed over head blocks in the program) to an fp32 buffer, a chunk of queries at a time; the chunk's pairs
    are sorted by key row and a segment-sum kernel adds each key's rows in that fixed order.
(The one-pass forms, dQ and dKV from recomputed scores with atomics or the sorted scatter, ran 1.3-2.7x slower on
the H200 and were removed: README.md.)

Shape legend: B batch, T queries, S keys, H heads, D = V + R latent dims, K selected slots, N = B*T tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestack.ops.dsa.triton_attn_fwd import INTERPRET, LOG2E, padded_dims

DKV_MODES = ("kmajor_ds", "sorted_ds")  # pass 1 dKV + dS, pass 2 dQ from dS (no recomputed scores)
SORTED_BUFFER_BYTES = 4 * 2**30  # fp32 contribution rows held at once by the sorted scatter


def _bwd_configs(shapes):
    """(BLOCK_H, BLOCK_K, warps, stages) list -> configs; one config under the interpreter."""
    if INTERPRET:
        return [triton.Config({"BLOCK_H": 16, "BLOCK_K": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_H": bh, "BLOCK_K": bk}, num_warps=w, num_stages=s) for bh, bk, w, s in shapes]


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
# Pass-1 work order: each token's slots sorted by key row first (slot order is free: P, dS and the rows follow it),
# then tiles of TOKEN_TILE consecutive tokens with the slot block as the slower index inside the tile, so the
# programs running together add into one band of key rows (slot block j of a token ~ its j-th key quantile) and the
# tile's Q and dO (TOKEN_TILE x 136 KB at H = 64) stay in L2 across its slot blocks. (Slot blocks of one token
# together instead: 125 vs 101 ms at H200, T=32768, H=64.)
TOKEN_TILE = 64


def _dkv_ds_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_H": 16, "BLOCK_K": 16, "BLOCK_C": 32}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_H": bh, "BLOCK_K": bk, "BLOCK_C": bc}, num_warps=w, num_stages=s, maxnreg=r)
            for bh, bk, bc, w, s, r in _DKV_DS_SHAPES]  # fmt: skip


def _prune_dkv_ds(configs, named_args, **kwargs):
    """Head blocks as prune_head_blocks, over fewer candidates (the deterministic rows output tunes over the first
    two configs, the atomic one over the first three), then what fits the device."""
    from moestack.ops.launch import fit_configs

    args = {**named_args, **kwargs}
    cand = configs[:2] if args.get("DKV_OUT") == "rows" else configs[:3]
    return fit_configs(_head_blocks(cand, args["H"]), args, "dsa_dkv", fallback=_dkv_ds_fallback())


def _dkv_ds_fallback():
    # one stage: fp32 at value widths below one column chunk (the tiny preset without autocast), where the tuned
    # configs stage their dS / P products per stage and need 263-337 KB (compiled: 271,360 B at 64 x 64, 3 stages)
    return [triton.Config({"BLOCK_H": 64, "BLOCK_K": bk, "BLOCK_C": 64}, num_warps=w, num_stages=1)
            for bk, w in ((64, 4), (32, 2))]


def _prune_dq_ds(configs, named_args, **kwargs):
    from moestack.ops.launch import fit_configs

    args = {**named_args, **kwargs}
    return fit_configs(_head_blocks(configs, args["H"]), args, "dsa_dq")


def _head_blocks(configs, H: int):
    """Head blocks no wider than needed (64 kept for few heads: wgmma wants 64 rows)."""
    cap = max(64, triton.next_power_of_2(H))
    return [c for c in configs if c.kwargs["BLOCK_H"] <= cap] or configs[-1:]


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
def _add_rows(ptrs, x, mask, DKV_OUT: tl.constexpr, accumulate):
    """x into fp32 rows: relaxed atomics ("atomic"); stored, added to what is there if accumulate ("rows")."""
    if DKV_OUT == "rows":
        if accumulate:
            x += tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, x, mask=mask)
    else:
        tl.atomic_add(ptrs, x, mask=mask, sem="relaxed")


@triton.autotune(
    configs=_dkv_ds_configs(),
    key=["H", "K", "V", "R", "DKV_OUT", "TOKEN_TILE"],
    prune_configs_by={"early_config_prune": _prune_dkv_ds},
    reset_to_zero=["DKV"],  # atomics add into DKV; the rows form accumulates over head blocks in place
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
    """Pass 1 of the two-pass backward. One program per (token n0 + i, i < n, block of BLOCK_K slots), in tiles of
    TOKEN_TILE tokens (programs past the last token do nothing). Heads in blocks of BLOCK_H: key-major
    S^T = K Q^T, dP^T = V dO^T [BLOCK_K, BLOCK_H] (contractions streamed in BLOCK_C chunks), P^T, dS^T; dS^T
    (scaled, q dtype) is stored to DS[i] [K, HP] for pass 2 (dQ = dS K; HP = H padded to a multiple of BLOCK_H: the
    stores carry no head mask, so they vectorise; padded heads get 0), and the dKV rows dS^T Q + P^T dO go out in
    BLOCK_C-column chunks: DKV_OUT "atomic", relaxed fp32 atomics into DKV[b, idx] (one per element and head
    block); "rows", written to DKV = BUF[i] [K, D] fp32 (summed over head blocks by this program) for the sorted
    scatter."""
    pid = tl.program_id(0)
    n_kb = tl.cdiv(K, BLOCK_K)
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
    prune_configs_by={"early_config_prune": _prune_dq_ds},
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


def _dkv_ds_pass(q, kv, idx, do, lse, delta, scale, dst, ds, n0, n, out):
    """Pass 1 over tokens [n0, n0 + n): dS into ds [n, K, HP]; dKV by atomics into dst = dkv32 [B, S, D] fp32
    (out "atomic"), or the contribution rows into dst = buf [>= n, K, D] fp32 ("rows")."""
    T, H, D = q.shape[1], q.shape[2], q.shape[3]
    K, V = idx.shape[-1], do.shape[-1]
    VP, RP = padded_dims(V, D - V)

    tile = TOKEN_TILE

    def grid(meta):
        return (triton.cdiv(n, tile) * tile * triton.cdiv(K, meta["BLOCK_K"]),)

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
    idx = torch.sort(idx, dim=-1).values.contiguous()  # slots in key order (see TOKEN_TILE); -1 slots first
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
    dkv_mode: str = "kmajor_ds",
    sorted_buffer_bytes: int = SORTED_BUFFER_BYTES,
    ds_buffer_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (dq [B,T,H,D] q.dtype, dkv [B,S,D] kv.dtype) of sparse_mqa_fwd's outputs."""
    if dkv_mode not in DKV_MODES:
        raise ValueError(f"dkv_mode '{dkv_mode}' is not one of {DKV_MODES}")
    q, kv, do = q.contiguous(), kv.contiguous(), do.contiguous()
    idx = idx.to(torch.int32).contiguous()
    lse = lse.contiguous()
    delta = attention_delta(o, do, dlse)
    dq = torch.full_like(q, float("nan"))
    dkv32 = torch.zeros(kv.shape, device=kv.device, dtype=torch.float32)
    ds_bytes = DS_BUFFER_BYTES if ds_buffer_bytes is None else ds_buffer_bytes
    _two_pass_bwd(q, kv, idx, do, lse, delta, scale, dq, dkv32, dkv_mode == "sorted_ds", ds_bytes,
                  sorted_buffer_bytes)
    return dq, dkv32.to(kv.dtype)
