"""KDA backward in Triton: a reverse state recurrence and a fused intra-chunk gradient kernel.

Shape legend and the forward quantities (b, Akk, Aqk, X, W, U, Qp, Kd, D) as in triton_fwd.py. Per chunk, with
S the state entering it, dS' the gradient of the state leaving it and dO the output gradient:
    dD  = Aqk^T dO + Kd dS'                                  (reverse recurrence, sequential)
    dS  = Diag(exp(b_last)) dS' + Qp^T dO - W^T dD
    dQp = dO S^T, dW = -dD S^T, dKd = D dS'^T, dAqk = Tril(dO D^T), dU = dD          (intra kernel, parallel)
then through the WY form (dY = X^T [dW | dU], dN = -StrictTril(dY [W | U]^T)), the decayed scores, the
cumsum (dg = reverse cumsum of db), the gate, the L2 norm and the beta sigmoid. README.md has the derivation.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moestack.ops.kda.triton_fwd import (
    BT,
    LOWP_DT,
    SUB,
    _chunk_coords,
    _configs,
    _exact_diag_factor,
    _intra_scores,
    _named_choice,
    _row,
    _gc_row,
    _load_gate,
    _state_ptr,
    _stripe_factors,
    _tok_ptr,
    _tok_ptr_t,
    _unit_lower_inverse,
)


# First (the single config without autotuning): BV = 32 at 8 warps compiles without spills at K = V = 128
# (ptxas, sm_90); 4 warps spill 0.5-0.7 KB per thread.
@triton.autotune(configs=_configs([
    triton.Config({"BV": 32}, num_warps=8, num_stages=2),
    triton.Config({"BV": 64}, num_warps=8, num_stages=2),
    triton.Config({"BV": 32}, num_warps=4, num_stages=2),
    triton.Config({"BV": 64}, num_warps=4, num_stages=2),
]), key=["K", "V"])
@triton.jit
def kda_bwd_kernel_recurrence(
    qp, kd, w, aqk, gl, do, dht, chunk_offsets, cu_seqlens,
    dh, dd, dh0,
    H,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
):
    """One program per (V-block, sequence, head), chunks in reverse. Stores dS' per chunk (dh [NC, H, K, V]),
    dD (dd [T, H, V]) and the initial-state gradient (dh0 [N, H, K, V] fp32)."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int32)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int32)
    n_t = tl.cdiv(eos - bos, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    DT = w.dtype.element_ty

    b_ds = tl.zeros([BK, BV], tl.float32)
    if HAS_DHT:
        p_dht = _state_ptr(dht, i_n, H, i_h, K, V, BK, BV, i_v * BV)
        b_ds += tl.load(p_dht, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    for i_r in range(0, n_t):
        i_j = n_t - 1 - i_r
        t0 = bos + i_j * BT
        n = eos - t0
        i_c = c0 + i_j
        tl.store(_state_ptr(dh, i_c, H, i_h, K, V, BK, BV, i_v * BV), b_ds.to(dh.dtype.element_ty),
                 boundary_check=(0, 1))
        p_do = _tok_ptr(do, t0, n, H, i_h, V, BT, BV, i_v * BV)
        b_do = tl.load(p_do, boundary_check=(0, 1), padding_option="zero").to(DT)
        b_at = tl.load(_tok_ptr_t(aqk, t0, n, H, i_h, BT, BT, BT), boundary_check=(0, 1), padding_option="zero")
        b_kd = tl.load(_tok_ptr(kd, t0, n, H, i_h, K, BT, BK), boundary_check=(0, 1), padding_option="zero")
        b_qpt = tl.load(_tok_ptr_t(qp, t0, n, H, i_h, K, BT, BK), boundary_check=(0, 1), padding_option="zero")
        b_wt = tl.load(_tok_ptr_t(w, t0, n, H, i_h, K, BT, BK), boundary_check=(0, 1), padding_option="zero")
        b_bl = tl.load(gl + (i_c * H + i_h).to(tl.int64) * K + o_k, mask=m_k, other=0.0)
        b_dd = tl.dot(b_at, b_do) + tl.dot(b_kd, b_ds.to(DT))
        tl.store(_tok_ptr(dd, t0, n, H, i_h, V, BT, BV, i_v * BV), b_dd.to(dd.dtype.element_ty),
                 boundary_check=(0, 1))
        b_ds = b_ds * tl.exp(b_bl)[:, None] + tl.dot(b_qpt, b_do) - tl.dot(b_wt, b_dd.to(DT))
    if STORE_DH0:
        tl.store(_state_ptr(dh0, i_n, H, i_h, K, V, BK, BV, i_v * BV), b_ds, boundary_check=(0, 1))


@triton.jit
def _lp(x, LOWP: tl.constexpr):
    """A dot operand: bf16 when LOWP (fp32 accumulate), else as is (fp32 -> tf32 on the GPU)."""
    if LOWP:
        return x.to(LOWP_DT)
    else:
        return x


@triton.jit
def _intra_scores_bwd(b_q, b_k, b_b, p_gc, n, stride, ncol, b_da, b_dn, slow, b_dq, b_dk, b_db,
                      BT: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, LOWP: tl.constexpr = False):
    """Add the gradients through Aqk (dA, lower incl.) and Akk (dN = d Akk, strictly lower) to dq~, dk and db.

    Every score term is x_i exp(b_i - b_j) y_j, so its log-decay gradient is x_i dx_i at row i minus y_j dy_j at j.
    LOWP: the dots take bf16 operands (b_da, b_dn may already be bf16), fp32 accumulate.
    """
    if LOWP:
        b_da_d, b_dn_d = b_da.to(LOWP_DT), b_dn.to(LOWP_DT)
    else:
        b_da_d, b_dn_d = b_da, b_dn
    b_da_t, b_dn_t = tl.trans(b_da_d), tl.trans(b_dn_d)
    for c in range(BT // SUB):  # a runtime loop: one copy of the body (smem, compile time)
        r = _gc_row(p_gc, c * SUB + SUB - 1, n, stride, ncol, BK)
        e_l, e_r = _stripe_factors(b_b, r, c, slow, BT, SUB)
        b_kr = _lp(b_k * e_r, LOWP)
        b_t = e_l * tl.dot(b_da_d, b_kr)
        b_dq += b_t
        b_db += b_q * b_t
        b_t = e_l * tl.dot(b_dn_d, b_kr)
        b_dk += b_t
        b_db += b_k * b_t
        b_t = e_r * (tl.dot(b_da_t, _lp(b_q * e_l, LOWP)) + tl.dot(b_dn_t, _lp(b_k * e_l, LOWP)))
        b_dk += b_t
        b_db -= b_k * b_t
    if slow:
        b_dq, b_dk, b_db = _intra_scores_bwd_exact(b_q, b_k, b_b, b_da, b_dn, b_dq, b_dk, b_db, BT, SUB)
    return b_dq, b_dk, b_db


@triton.jit
def _intra_scores_bwd_exact(b_q, b_k, b_b, b_da, b_dn, b_dq, b_dk, b_db, BT: tl.constexpr, SUB: tl.constexpr):
    """The diagonal sub-blocks' score gradients one column at a time (chunks flagged for the exact path)."""
    o_t = tl.arange(0, BT)
    for j in range(BT):
        b_e = _exact_diag_factor(b_b, j, BT, SUB, False)  # [BT, BK] exp(b_i - b_j), rows i >= j in j's block
        sel_c = (o_t == j)[None, :]
        b_da_j = tl.sum(tl.where(sel_c, b_da.to(tl.float32), 0.0), 1)  # column j of dA
        b_dn_j = tl.sum(tl.where(sel_c, b_dn.to(tl.float32), 0.0), 1)  # column j of dAkk (0 at i == j)
        b_ke = b_e * _row(b_k, j, BT)[None, :]
        b_t = b_da_j[:, None] * b_ke
        b_dq += b_t
        b_db += b_q * b_t
        b_t = b_dn_j[:, None] * b_ke
        b_dk += b_t
        b_db += b_k * b_t
        b_ck_j = tl.sum((b_da_j[:, None] * b_q + b_dn_j[:, None] * b_k) * b_e, 0)
        b_t = tl.where((o_t == j)[:, None], b_ck_j[None, :], 0.0)
        b_dk += b_t
        b_db -= b_k * b_t
    return b_dq, b_dk, b_db


@triton.jit
def _intra_scores_bwd_joined(q, k, rq, rk, gc, t0, n, H, i_h, col0, scale, b_k, b_b, p_gc, b_dan, b_dant,
                             b_dq, b_dk, b_db, K: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr,
                             BKC: tl.constexpr, LOWP: tl.constexpr):
    """_intra_scores_bwd with two dots per stripe instead of four (no exact path: B3B_FORM=joined runs split):
    b_dan = [dA; dN] ([2 BT, BT]) meets k_j exp(r - b_j) once for dq and dk together, and b_dant = [dA^T | dN^T]
    ([BT, 2 BT]) meets the stacked [q~; k] exp(b_i - r) once. The stacked rows are read from memory."""
    o_r = tl.arange(0, 2 * BT)
    row = o_r % BT
    is_q = o_r < BT  # top half: q~ (meets dA), bottom: k (meets dN)
    m_r = row < n
    o_k = col0 + tl.arange(0, BKC)
    m_2 = m_r[:, None] & (o_k < K)[None, :]
    offs = (t0 + row).to(tl.int64) * H + i_h
    p_x = offs[:, None] * K + o_k[None, :]
    b_x = tl.load(q + p_x, mask=m_2 & is_q[:, None], other=0.0).to(tl.float32) \
        + tl.load(k + p_x, mask=m_2 & ~is_q[:, None], other=0.0).to(tl.float32)
    b_s = tl.load(rq + offs, mask=m_r & is_q, other=0.0) * scale + tl.load(rk + offs, mask=m_r & ~is_q, other=0.0)
    b_x = b_x * b_s[:, None]  # [q~; k_hat]
    b_bl = _gc_row(p_gc, BT - 1, n, H * K, K - col0, BKC)
    b_b2 = tl.where(m_r[:, None], tl.load(gc + p_x, mask=m_2, other=0.0), b_bl[None, :])
    o_t = tl.arange(0, BT)
    b_acc = tl.zeros([2 * BT, BKC], tl.float32)  # [dq~; dk] from the row side
    for c in range(BT // SUB):
        r = _gc_row(p_gc, c * SUB + SUB - 1, n, H * K, K - col0, BKC)
        m_l = (row >= c * SUB)[:, None]
        e_l = tl.where(m_l, tl.exp(tl.where(m_l, b_b2 - r[None, :], 0.0)), 0.0)  # [2 BT, BKC]
        m_s = ((o_t >= c * SUB) & (o_t < c * SUB + SUB))[:, None]
        e_r = tl.where(m_s, tl.exp(tl.where(m_s, r[None, :] - b_b, 0.0)), 0.0)  # [BT, BKC]
        b_acc += e_l * tl.dot(b_dan, _lp(b_k * e_r, LOWP))
        b_t = e_r * tl.dot(b_dant, _lp(b_x * e_l, LOWP))  # column side, dk only
        b_dk += b_t
        b_db -= b_k * b_t
    b_top, b_bot = tl.split(tl.permute(tl.reshape(b_acc, [2, BT, BKC]), (1, 2, 0)))
    b_xt, b_xb = tl.split(tl.permute(tl.reshape(b_x * b_acc, [2, BT, BKC]), (1, 2, 0)))
    return b_dq + b_top, b_dk + b_bot, b_db + b_xt + b_xb


@triton.jit
def _tok_ptr_tc(x, t0, n_rows, H, i_h, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, col0):
    """Block pointer to the [BD, BR] tile of x^T (x [T, H, D] token-major) at columns col0.. of x."""
    return tl.make_block_ptr(x + (t0.to(tl.int64) * H + i_h) * D, (D, n_rows), (1, H * D), (col0, 0), (BD, BR),
                             (0, 1))


@triton.jit
def _intra_scores_bwd_narrow(k, gc, rk, p_da, p_dn, p_scr, t0, n, H, i_h, col0, b_q, b_k, b_b, b_bl, slow,
                             b_dq, b_dk, b_db, K: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr,
                             BKC: tl.constexpr, LOWP: tl.constexpr):
    """_intra_scores_bwd without the masked full-size operands: per 16-column stripe c, the dots read dA[:, c]
    ([BT, SUB], straight from p_da / p_dn) and the stripe's own rows of k, b ([SUB, BKC], from memory), so
    dq, dk += e_l * (dA[:, c] @ (k_c e_r)) is a K = 16 dot and the transposed term (dA[:, c]^T @ (q e_l)) has 16
    output rows, not 64 (a quarter of the tensor-core work and of the staged operands). Those rows, disjoint
    across stripes, go through p_scr (this channel block of a consumed fp32 buffer) into dk, db."""
    o_t = tl.arange(0, BT)
    o_s = tl.arange(0, SUB)
    o_k = col0 + tl.arange(0, BKC)
    m_k = o_k < K
    p_gc = gc + (t0.to(tl.int64) * H + i_h) * K + col0
    tl.debug_barrier()  # p_scr was read just before, by other threads
    for c in range(BT // SUB):
        r = _gc_row(p_gc, c * SUB + SUB - 1, n, H * K, K - col0, BKC)
        lo = c * SUB + tl.where(slow, SUB, 0)  # slow: the diagonal block goes by the exact path
        m_l = (o_t >= lo)[:, None]
        e_l = tl.where(m_l, tl.exp(tl.where(m_l, b_b - r[None, :], 0.0)), 0.0)  # [BT, BKC]
        rows = c * SUB + o_s
        m_s = rows < n
        m_sk = m_s[:, None] & m_k[None, :]
        p_rows = (t0 + rows).to(tl.int64) * H + i_h  # [SUB]
        b_kc = tl.load(k + p_rows[:, None] * K + o_k[None, :], mask=m_sk, other=0.0).to(tl.float32) \
            * tl.load(rk + p_rows, mask=m_s, other=0.0)[:, None]
        b_bc = tl.load(gc + p_rows[:, None] * K + o_k[None, :], mask=m_sk, other=0.0)
        b_bc = tl.where(m_s[:, None], b_bc, b_bl[None, :])
        e_r = tl.exp(r[None, :] - b_bc)  # [SUB, BKC], in [1, e^span]
        b_kr = _lp(b_kc * e_r, LOWP)
        b_dac = _lp(tl.load(_tok_ptr(p_da, t0, n, H, i_h, BT, BT, SUB, c * SUB), boundary_check=(0, 1),
                            padding_option="zero"), LOWP)  # [BT, SUB]
        b_dnc = _lp(tl.load(_tok_ptr(p_dn, t0, n, H, i_h, BT, BT, SUB, c * SUB), boundary_check=(0, 1),
                            padding_option="zero"), LOWP)
        b_t = e_l * tl.dot(b_dac, b_kr)
        b_dq += b_t
        b_db += b_q * b_t
        b_t = e_l * tl.dot(b_dnc, b_kr)
        b_dk += b_t
        b_db += b_k * b_t
        b_dact = _lp(tl.load(_tok_ptr_tc(p_da, t0, n, H, i_h, BT, BT, SUB, c * SUB), boundary_check=(0, 1),
                             padding_option="zero"), LOWP)  # [SUB, BT]
        b_dnct = _lp(tl.load(_tok_ptr_tc(p_dn, t0, n, H, i_h, BT, BT, SUB, c * SUB), boundary_check=(0, 1),
                             padding_option="zero"), LOWP)
        b_tc = e_r * (tl.dot(b_dact, _lp(b_q * e_l, LOWP)) + tl.dot(b_dnct, _lp(b_k * e_l, LOWP)))  # [SUB, BKC]
        tl.store(p_scr + p_rows[:, None] * K + o_k[None, :], b_tc, mask=m_sk)
    tl.debug_barrier()
    b_t = tl.load(_tok_ptr(p_scr, t0, n, H, i_h, K, BT, BKC, col0), boundary_check=(0, 1), padding_option="zero")
    b_dk += b_t
    b_db -= b_k * b_t
    if slow:
        b_da = tl.load(_tok_ptr(p_da, t0, n, H, i_h, BT, BT, BT), boundary_check=(0, 1), padding_option="zero")
        b_dn = tl.load(_tok_ptr(p_dn, t0, n, H, i_h, BT, BT, BT), boundary_check=(0, 1), padding_option="zero")
        b_dq, b_dk, b_db = _intra_scores_bwd_exact(b_q, b_k, b_b, b_da, b_dn, b_dq, b_dk, b_db, BT, SUB)
    return b_dq, b_dk, b_db


@triton.jit
def _wy_inputs(k, beta, gc, rk, i_h, t0, t_end, H, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BETA_SIGMOID: tl.constexpr):
    """k_hat [BT, BK], b [BT, BK] (padded rows repeat the last valid row), b_last [BK], beta [BT] of a chunk,
    from the inputs and the forward's saved gc / rk."""
    o_t = tl.arange(0, BT)
    m_t = (t0 + o_t) < t_end
    n = t_end - t0
    b_bl = _gc_row(gc + (t0.to(tl.int64) * H + i_h) * K, BT - 1, n, H * K, K, BK)
    b_b = tl.load(_tok_ptr(gc, t0, n, H, i_h, K, BT, BK), boundary_check=(0, 1), padding_option="zero")
    b_b = tl.where(m_t[:, None], b_b, b_bl[None, :])
    b_rk = tl.load(rk + (t0 + o_t).to(tl.int64) * H + i_h, mask=m_t, other=0.0)
    b_k = tl.load(_tok_ptr(k, t0, n, H, i_h, K, BT, BK), boundary_check=(0, 1),
                  padding_option="zero").to(tl.float32) * b_rk[:, None]
    b_beta = tl.load(beta + (t0 + o_t).to(tl.int64) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b_beta = tl.where(m_t, tl.sigmoid(b_beta), 0.0)
    return b_k, b_b, b_bl, b_beta


@triton.jit
def _akk_by_channel_blocks(k, gc, rk, i_h, t0, t_end, H, slow, K: tl.constexpr, BT: tl.constexpr,
                           SUB: tl.constexpr, BKS: tl.constexpr, LOWP: tl.constexpr = False):
    """Akk [BT, BT] (strictly lower) summed over channel blocks of BKS, each loaded from k, rk and gc: the
    score loop keeps ~6 [BT, BKS] tiles live, which at BKS = K = 128 alone filled the register file."""
    o_t = tl.arange(0, BT)
    m_t = (t0 + o_t) < t_end
    n = t_end - t0
    b_rk = tl.load(rk + (t0 + o_t).to(tl.int64) * H + i_h, mask=m_t, other=0.0)
    p_gc = gc + (t0.to(tl.int64) * H + i_h) * K
    b_akk = tl.zeros([BT, BT], tl.float32)
    for col0 in range(0, K, BKS):
        b_bl = _gc_row(p_gc + col0, BT - 1, n, H * K, K - col0, BKS)
        b_b = tl.load(_tok_ptr(gc, t0, n, H, i_h, K, BT, BKS, col0), boundary_check=(0, 1), padding_option="zero")
        b_b = tl.where(m_t[:, None], b_b, b_bl[None, :])
        b_k = tl.load(_tok_ptr(k, t0, n, H, i_h, K, BT, BKS, col0), boundary_check=(0, 1),
                      padding_option="zero").to(tl.float32) * b_rk[:, None]
        b_a, _ = _intra_scores(b_k, b_k, b_b, p_gc + col0, n, H * K, K - col0, slow, BT, SUB, BKS, False, LOWP)
        b_akk += b_a
    return b_akk


# At K = V = 128, BV = BKS = 32 and 8 warps compiles with ~no spills (ptxas, sm_90); BV = 64 spills ~1 KB.
@triton.autotune(configs=_configs([
    triton.Config({"BV": 32, "BKS": 32}, num_warps=8, num_stages=1),
    triton.Config({"BV": 64, "BKS": 32}, num_warps=8, num_stages=1),
    triton.Config({"BV": 64, "BKS": 64}, num_warps=16, num_stages=1),
]), key=["K", "V"])
@triton.jit
def kda_bwd_kernel_wy(
    k, v, beta, gc, rk, flag, chunk_map, cu_seqlens,
    h, dh, d, dd, do, xinv, akk, w,
    dv, dbeta, p_dqp, p_dkd, p_dkp, p_da, p_dn, p_dbl,
    H,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BKS: tl.constexpr, BETA_SIGMOID: tl.constexpr, LOAD_X: tl.constexpr = False, LOWP: tl.constexpr = False,
):
    """Backward, part 1 of 2, one program per (chunk slot, head): the contractions over V and the WY form.

    Writes dv and dbeta (final) and, as fp32 partials for kda_bwd_kernel_scores: dQp = dO S^T, dKd = D dS'^T,
    dKp = Diag(beta) X^T dW ([T, H, K]); dAqk and d(Diag(beta) Akk) ([T, H, BT]); exp(b_last) rowsum(S dS')
    ([NC, H, K]). Recomputes Akk and X = (I + Diag(beta) Akk)^-1 from k, b (gc) and beta, or with LOAD_X reads
    them (xinv, akk) and W (w) as the forward wrote them. LOWP: the WY dots take bf16 operands.
    """
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, t_end = _chunk_coords(chunk_map, cu_seqlens, i_c, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t = (t0 + o_t) < t_end
    n = t_end - t0
    DT = h.dtype.element_ty

    # Two passes over V, each with few accumulators live (one pass held six tiles and spilled ~4 KB per thread);
    # the second re-reads the chunk's S, which is cheaper than the spills.
    # Pass 1: dQp = dO S^T, dKd = D dS'^T, dAqk = Tril(dO D^T), rowsum(S * dS').
    b_dqp = tl.zeros([BT, BK], tl.float32)
    b_dkd = tl.zeros([BT, BK], tl.float32)
    b_da = tl.zeros([BT, BT], tl.float32)
    b_dsl = tl.zeros([BK], tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        b_do = tl.load(_tok_ptr(do, t0, n, H, i_h, V, BT, BV, i_v * BV), boundary_check=(0, 1),
                       padding_option="zero").to(DT)
        b_dv_ = tl.load(_tok_ptr(d, t0, n, H, i_h, V, BT, BV, i_v * BV), boundary_check=(0, 1),
                        padding_option="zero")
        b_h = tl.load(_state_ptr(h, i_c, H, i_h, K, V, BK, BV, i_v * BV), boundary_check=(0, 1),
                      padding_option="zero")
        b_dh = tl.load(_state_ptr(dh, i_c, H, i_h, K, V, BK, BV, i_v * BV), boundary_check=(0, 1),
                       padding_option="zero")
        b_dqp += tl.dot(b_do, tl.trans(b_h))
        b_dkd += tl.dot(b_dv_, tl.trans(b_dh))
        b_da += tl.dot(b_do, tl.trans(b_dv_))
        b_dsl += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
    tl.store(_tok_ptr(p_dqp, t0, n, H, i_h, K, BT, BK), b_dqp, boundary_check=(0, 1))
    tl.store(_tok_ptr(p_dkd, t0, n, H, i_h, K, BT, BK), b_dkd, boundary_check=(0, 1))
    b_da = tl.where((o_t[:, None] >= o_t[None, :]) & m_t[:, None], b_da, 0.0)
    tl.store(_tok_ptr(p_da, t0, n, H, i_h, BT, BT, BT), b_da, boundary_check=(0, 1))

    # Pass 2: Akk and X = (I + Diag(beta) Akk)^-1 (again, or read back), then dW = -dD S^T, dU = dD through WY.
    b_bl = _gc_row(gc + (t0.to(tl.int64) * H + i_h) * K, BT - 1, n, H * K, K, BK)
    tl.store(p_dbl + (i_c * H + i_h).to(tl.int64) * K + o_k, tl.exp(b_bl) * b_dsl, mask=o_k < K)
    b_beta = tl.load(beta + (t0 + o_t).to(tl.int64) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b_beta = tl.where(m_t, tl.sigmoid(b_beta), 0.0)
    if LOAD_X:  # padded rows read as 0 (the forward's are identity rows of X): they only ever meet zero rows
        b_akk = tl.load(_tok_ptr(akk, t0, n, H, i_h, BT, BT, BT), boundary_check=(0, 1),
                        padding_option="zero").to(tl.float32)
        b_minv = tl.load(_tok_ptr(xinv, t0, n, H, i_h, BT, BT, BT), boundary_check=(0, 1), padding_option="zero")
    else:
        slow = tl.load(flag + i_c * H + i_h) != 0
        b_akk = _akk_by_channel_blocks(k, gc, rk, i_h, t0, t_end, H, slow, K, BT, SUB, BKS, LOWP)
        b_minv = _unit_lower_inverse(b_beta[:, None] * b_akk, BT)
    b_minv_d = _lp(b_minv, LOWP)
    b_minv_t = tl.trans(b_minv_d)
    b_dsw = tl.zeros([BT, BK], tl.float32)  # dD S^T  (= -dW)
    b_gm = tl.zeros([BT, BT], tl.float32)  # dD (beta v)^T  (= dU Y_v^T)
    b_dbeta = tl.zeros([BT], tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        b_ddv = tl.load(_tok_ptr(dd, t0, n, H, i_h, V, BT, BV, i_v * BV), boundary_check=(0, 1),
                        padding_option="zero")
        b_v = tl.load(_tok_ptr(v, t0, n, H, i_h, V, BT, BV, i_v * BV), boundary_check=(0, 1),
                      padding_option="zero").to(tl.float32)
        b_h = tl.load(_state_ptr(h, i_c, H, i_h, K, V, BK, BV, i_v * BV), boundary_check=(0, 1),
                      padding_option="zero")
        b_dsw += tl.dot(b_ddv, tl.trans(b_h))
        if LOWP:
            b_ddf = b_ddv.to(LOWP_DT)
        else:
            b_ddf = b_ddv.to(tl.float32)
        b_gm += tl.dot(b_ddf, tl.trans(_lp(b_beta[:, None] * b_v, LOWP)))
        b_dyv = tl.dot(b_minv_t, b_ddf)  # X^T dU
        tl.store(_tok_ptr(dv, t0, n, H, i_h, V, BT, BV, i_v * BV), (b_beta[:, None] * b_dyv).to(dv.dtype.element_ty),
                 boundary_check=(0, 1))
        b_dbeta += tl.sum(b_dyv * b_v, 1)
    # WY form: W = X Diag(beta) (k exp(b)), U = X Diag(beta) v; dN = -StrictTril(X^T dW W^T + X^T dU U^T).
    # The K-wide part goes by channel blocks (registers): dD S^T is parked in p_dkp, whose block c is then read
    # and overwritten by Diag(beta) X^T dW.
    tl.store(_tok_ptr(p_dkp, t0, n, H, i_h, K, BT, BK), b_dsw, boundary_check=(0, 1))
    tl.debug_barrier()
    b_dn = tl.dot(_lp(tl.dot(b_minv_t, _lp(b_gm, LOWP)), LOWP), tl.trans(b_minv_d))
    b_rk = tl.load(rk + (t0 + o_t).to(tl.int64) * H + i_h, mask=m_t, other=0.0)
    for col0 in range(0, K, BKS):
        p_c = _tok_ptr(p_dkp, t0, n, H, i_h, K, BT, BKS, col0)
        b_dsw_c = tl.load(p_c, boundary_check=(0, 1), padding_option="zero")
        b_b = tl.load(_tok_ptr(gc, t0, n, H, i_h, K, BT, BKS, col0), boundary_check=(0, 1), padding_option="zero")
        b_kp = tl.load(_tok_ptr(k, t0, n, H, i_h, K, BT, BKS, col0), boundary_check=(0, 1),
                       padding_option="zero").to(tl.float32) * b_rk[:, None] * tl.exp(b_b)  # 0 on padded rows
        b_dyk = -tl.dot(b_minv_t, _lp(b_dsw_c, LOWP))  # X^T dW
        b_dbeta += tl.sum(b_dyk * b_kp, 1)
        if LOAD_X:  # W = X Diag(beta) (k exp(b)) as the forward stored it
            b_w = tl.load(_tok_ptr(w, t0, n, H, i_h, K, BT, BKS, col0), boundary_check=(0, 1),
                          padding_option="zero").to(tl.float32)
        else:
            b_w = tl.dot(b_minv_d, _lp(b_beta[:, None] * b_kp, LOWP))
        b_dn += tl.dot(_lp(b_dyk, LOWP), tl.trans(_lp(b_w, LOWP)))  # (X^T dW) W^T
        tl.debug_barrier()  # every thread has read block c before it is overwritten
        tl.store(p_c, b_beta[:, None] * b_dyk, boundary_check=(0, 1))
    b_dn = tl.where(o_t[:, None] > o_t[None, :], -b_dn, 0.0)  # d(Diag(beta) Akk)
    b_dbeta += tl.sum(b_dn * b_akk, 1)
    tl.store(_tok_ptr(p_dn, t0, n, H, i_h, BT, BT, BT), b_beta[:, None] * b_dn, boundary_check=(0, 1))
    if BETA_SIGMOID:
        b_dbeta = b_dbeta * b_beta * (1.0 - b_beta)
    tl.store(dbeta + (t0 + o_t).to(tl.int64) * H + i_h, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)


@triton.autotune(configs=_configs([
    triton.Config({"BKC": 32}, num_warps=8, num_stages=1),
    triton.Config({"BKC": 64}, num_warps=8, num_stages=1),
    triton.Config({"BKC": 64}, num_warps=16, num_stages=1),
]), key=["K", "GATE", "L2NORM"], restore_value=["p_dqp", "p_dkd", "p_dkp"])  # parks d q_hat, d k_hat there
@triton.jit
def kda_bwd_kernel_scores(
    q, k, g, A_log, dt_bias, gc, rq, rk, flag, chunk_map, cu_seqlens,
    p_dqp, p_dkd, p_dkp, p_da, p_dn, p_dbl,
    dq, dk, dg, pd_dt, pd_alog,
    scale, H,
    K: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr, BKC: tl.constexpr,
    GATE: tl.constexpr, LOWER_BOUND: tl.constexpr, HAS_DT_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    LOWP: tl.constexpr = False, NARROW: tl.constexpr = False, SEL: tl.constexpr = 0, JOIN: tl.constexpr = False,
):
    """Backward, part 2 of 2, one program per (chunk slot, head), BKC channels at a time (all of this is
    per channel except the L2-norm rows): gradients through Aqk, Akk, Qp, Kd and W's k exp(b), the cumsum, the
    gate and the L2 norm. Writes dq, dk, dg and the per-chunk dt_bias / A_log partials (pd_dt, pd_alog).
    LOWP: the score-gradient dots take bf16 operands. NARROW: _intra_scores_bwd_narrow (stripe-sized operands)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, t_end = _chunk_coords(chunk_map, cu_seqlens, i_c, BT)
    o_t = tl.arange(0, BT)
    m_t = (t0 + o_t) < t_end
    n = t_end - t0
    slow = tl.load(flag + i_c * H + i_h) != 0
    if SEL == 1:  # fast chunks only: the exact path is not compiled in (its register pressure spilled)
        if slow:
            return
        slow = False
    elif SEL == 2:  # the chunks flagged for the exact path only
        if not slow:
            return
    b_rq = tl.load(rq + (t0 + o_t).to(tl.int64) * H + i_h, mask=m_t, other=0.0)
    b_rk = tl.load(rk + (t0 + o_t).to(tl.int64) * H + i_h, mask=m_t, other=0.0)
    if JOIN:  # [dA; dN] and [dA^T | dN^T], built once
        o_r = tl.arange(0, 2 * BT)
        m_r = (o_r % BT) < n
        p_r = ((t0 + o_r % BT).to(tl.int64) * H + i_h) * BT
        p_2 = p_r[:, None] + o_t[None, :]
        top = (o_r < BT)[:, None]
        b_dan = _lp(tl.load(p_da + p_2, mask=m_r[:, None] & top, other=0.0)
                    + tl.load(p_dn + p_2, mask=m_r[:, None] & ~top, other=0.0), LOWP)  # [2 BT, BT]
        p_2t = p_r[None, :] + o_t[:, None]
        topt = (o_r < BT)[None, :]
        b_dant = _lp(tl.load(p_da + p_2t, mask=m_r[None, :] & topt, other=0.0)
                     + tl.load(p_dn + p_2t, mask=m_r[None, :] & ~topt, other=0.0), LOWP)  # [BT, 2 BT]
    elif not NARROW:
        b_da = tl.load(_tok_ptr(p_da, t0, n, H, i_h, BT, BT, BT), boundary_check=(0, 1), padding_option="zero")
        b_dn = tl.load(_tok_ptr(p_dn, t0, n, H, i_h, BT, BT, BT), boundary_check=(0, 1), padding_option="zero")
        if LOWP:  # dot operands only: half the registers for the two tiles live through the channel loop
            b_da, b_dn = b_da.to(LOWP_DT), b_dn.to(LOWP_DT)

    # Pass 2: everything per channel block.
    b_pal = 0.0
    b_rdq = tl.zeros([BT], tl.float32)  # rowsum(q_hat * d q_hat), for the L2-norm backward
    b_rdk = tl.zeros([BT], tl.float32)
    for col0 in range(0, K, BKC):
        o_k = col0 + tl.arange(0, BKC)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(_tok_ptr(q, t0, n, H, i_h, K, BT, BKC, col0), boundary_check=(0, 1),
                      padding_option="zero").to(tl.float32) * (b_rq * scale)[:, None]
        b_k = tl.load(_tok_ptr(k, t0, n, H, i_h, K, BT, BKC, col0), boundary_check=(0, 1),
                      padding_option="zero").to(tl.float32) * b_rk[:, None]
        p_gc = gc + (t0.to(tl.int64) * H + i_h) * K + col0
        b_bl = _gc_row(p_gc, BT - 1, n, H * K, K - col0, BKC)
        b_b = tl.load(_tok_ptr(gc, t0, n, H, i_h, K, BT, BKC, col0), boundary_check=(0, 1), padding_option="zero")
        b_b = tl.where(m_t[:, None], b_b, b_bl[None, :])
        b_e = tl.exp(b_b)
        b_el = tl.exp(b_bl[None, :] - b_b)
        # Qp = q~ exp(b), Kd = k exp(b_last - b), Kp = k exp(b): their gradients and log-decay terms.
        b_dq_ = tl.load(_tok_ptr(p_dqp, t0, n, H, i_h, K, BT, BKC, col0), boundary_check=(0, 1),
                        padding_option="zero") * b_e
        b_t = tl.load(_tok_ptr(p_dkd, t0, n, H, i_h, K, BT, BKC, col0), boundary_check=(0, 1),
                      padding_option="zero") * b_el
        b_dbl = tl.load(p_dbl + (i_c * H + i_h).to(tl.int64) * K + o_k, mask=m_k, other=0.0) + tl.sum(b_k * b_t, 0)
        b_db = b_q * b_dq_ - b_k * b_t
        b_dk_ = b_t
        b_t = tl.load(_tok_ptr(p_dkp, t0, n, H, i_h, K, BT, BKC, col0), boundary_check=(0, 1),
                      padding_option="zero") * b_e
        b_dk_ += b_t
        b_db += b_k * b_t
        if JOIN:
            b_dq_, b_dk_, b_db = _intra_scores_bwd_joined(q, k, rq, rk, gc, t0, n, H, i_h, col0, scale, b_k, b_b,
                                                          p_gc, b_dan, b_dant, b_dq_, b_dk_, b_db, K, BT, SUB, BKC,
                                                          LOWP)
        elif NARROW:  # p_dkp's block col0 (read above) is free: scratch for the stripes' dk rows
            b_dq_, b_dk_, b_db = _intra_scores_bwd_narrow(k, gc, rk, p_da, p_dn, p_dkp, t0, n, H, i_h, col0, b_q,
                                                          b_k, b_b, b_bl, slow, b_dq_, b_dk_, b_db, K, BT, SUB,
                                                          BKC, LOWP)
        else:
            b_dq_, b_dk_, b_db = _intra_scores_bwd(b_q, b_k, b_b, p_gc, n, H * K, K - col0, b_da, b_dn, slow,
                                                   b_dq_, b_dk_, b_db, BT, SUB, BKC, LOWP)
        b_db += tl.where((o_t == BT - 1)[:, None], b_dbl[None, :], 0.0)
        b_dg = tl.where(m_tk, tl.cumsum(b_db, axis=0, reverse=True), 0.0)

        if GATE != 0:
            b_x, b_g = _load_gate(g, dt_bias, A_log, i_h, t0, t_end, H, col0, K, BT, BKC, GATE, LOWER_BOUND,
                                  HAS_DT_BIAS)
        if GATE == 1:
            a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
            b_s = tl.sigmoid(a * b_x)
            b_dx = b_dg * (LOWER_BOUND * a) * b_s * (1.0 - b_s)
            b_pal += tl.sum(tl.sum(b_dx * b_x, 1), 0)
        elif GATE == 2:
            a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
            b_dx = b_dg * (-a) * tl.sigmoid(b_x)
            b_pal += tl.sum(tl.sum(b_dg * b_g, 1), 0)
        else:
            b_dx = b_dg
        tl.store(_tok_ptr(dg, t0, n, H, i_h, K, BT, BKC, col0), b_dx.to(dg.dtype.element_ty), boundary_check=(0, 1))
        if GATE != 0:
            tl.store(pd_dt + (i_c * H + i_h).to(tl.int64) * K + o_k, tl.sum(b_dx, 0), mask=m_k)

        b_dq_ = b_dq_ * scale  # d q_hat
        if L2NORM:
            # The norm's backward needs whole rows: park d q_hat, d k_hat in the (consumed) partial buffers.
            b_qh = b_q / scale
            b_rdq += tl.sum(b_qh * b_dq_, 1)
            b_rdk += tl.sum(b_k * b_dk_, 1)
            tl.store(_tok_ptr(p_dqp, t0, n, H, i_h, K, BT, BKC, col0), b_dq_, boundary_check=(0, 1))
            tl.store(_tok_ptr(p_dkd, t0, n, H, i_h, K, BT, BKC, col0), b_dk_, boundary_check=(0, 1))
        else:
            tl.store(_tok_ptr(dq, t0, n, H, i_h, K, BT, BKC, col0), b_dq_.to(dq.dtype.element_ty),
                     boundary_check=(0, 1))
            tl.store(_tok_ptr(dk, t0, n, H, i_h, K, BT, BKC, col0), b_dk_.to(dk.dtype.element_ty),
                     boundary_check=(0, 1))
    if GATE != 0:
        tl.store(pd_alog + i_c * H + i_h, b_pal)

    if L2NORM:
        # Pass 3: d x = (d x_hat - x_hat * rowsum(x_hat * d x_hat)) / ||x||.
        for col0 in range(0, K, BKC):
            b_qh = tl.load(_tok_ptr(q, t0, n, H, i_h, K, BT, BKC, col0), boundary_check=(0, 1),
                           padding_option="zero").to(tl.float32) * b_rq[:, None]
            b_kh = tl.load(_tok_ptr(k, t0, n, H, i_h, K, BT, BKC, col0), boundary_check=(0, 1),
                           padding_option="zero").to(tl.float32) * b_rk[:, None]
            b_dqh = tl.load(_tok_ptr(p_dqp, t0, n, H, i_h, K, BT, BKC, col0), boundary_check=(0, 1),
                            padding_option="zero")
            b_dkh = tl.load(_tok_ptr(p_dkd, t0, n, H, i_h, K, BT, BKC, col0), boundary_check=(0, 1),
                            padding_option="zero")
            b_dq_ = b_rq[:, None] * (b_dqh - b_qh * b_rdq[:, None])
            b_dk_ = b_rk[:, None] * (b_dkh - b_kh * b_rdk[:, None])
            tl.store(_tok_ptr(dq, t0, n, H, i_h, K, BT, BKC, col0), b_dq_.to(dq.dtype.element_ty),
                     boundary_check=(0, 1))
            tl.store(_tok_ptr(dk, t0, n, H, i_h, K, BT, BKC, col0), b_dk_.to(dk.dtype.element_ty),
                     boundary_check=(0, 1))


# ---- launchers -----------------------------------------------------------------------------------------------


# Fixed launch configs for the two per-chunk backward kernels, read per call (benchmarks compare them in one
# process): $MOESTACK_KDA_B3A = "BV:BKS:warps[:maxnreg]", $MOESTACK_KDA_B3B = "BKC:warps[:maxnreg]"; unset =
# autotuned / first config. At 4 warps a program fits 255 registers and two CTAs share an SM (the 8-warp defaults
# run one per SM); "16:4:168" caps registers for three (split B3b: 100 B spills bf16, 196 B tf32, ptxas sm_90).
B3A_ENV, B3B_ENV = "MOESTACK_KDA_B3A", "MOESTACK_KDA_B3B"
# With the default BWD_X=saved / B3B_FORM=split (or bf16 dots) and the variables unset, fixed configs that passed
# every GPU test and timed fastest replace the autotuner, whose other candidates were never validated in bf16: B3a
# at BV 32 / BKS 32 or 64 / 32 with bf16 dots gave NaN (H200, sessions 3-4; fine in fp16 under the interpreter, so
# a GPU codegen issue is suspected; BKS 64 is the safe side).
B3A_DEFAULT = {"BV": 64, "BKS": 64, "num_warps": 8}
B3B_DEFAULT = {"BKC": 16, "num_warps": 4}
B3B_EXACT_CONFIG = {"BKC": 32, "num_warps": 8}  # the split forms' exact-path launch (tf32 dots), see kda_bwd_scores
# Backward variants (phase C), read once per forward call by triton_op (so a recompute matches its forward):
# $MOESTACK_KDA_BWD_X = "saved" (default: K1 also writes X fp32 and Akk, 384 B per token and head at bf16, and
# B3a reads them and W) or "recompute" (B3a recomputes Akk by channel blocks and inverts again: ~26 of its ~64 dots).
# $MOESTACK_KDA_BWD_DOTS = "wy" (default: bf16 operands, fp32 accumulate, in B3a's WY dots only; dg as in tf32),
# "tf32" or "bf16" (B3a's and B3b's score-gradient dots): bf16 is 6% faster than wy but puts the gate gradient dg
# at 4-5e-2 relative RMS vs fp64 (wy and tf32: 6-7.5e-3; benchmarks/kda_precision.py, H200 session 4). wy / bf16
# need BWD_X=saved: on the recompute-X path bf16 gave NaN on the H200 (session 3).
BWD_X_ENV, BWD_X = "MOESTACK_KDA_BWD_X", ("saved", "recompute")
BWD_DOTS_ENV, BWD_DOTS = "MOESTACK_KDA_BWD_DOTS", ("wy", "tf32", "bf16")
# $MOESTACK_KDA_B3B_FORM = "masked" (per 16-column stripe, full [BT, BT] x [BT, BKC] dots on masked operands,
# the exact path inline), "split" (default; the same, but the chunks flagged for the exact path go to a second
# launch, so the main one compiles without it: ptxas spills 288 -> 0 B at 32:8, 0 at 16:4), "narrow" (split, and
# stripe-sized operands read from memory: _intra_scores_bwd_narrow) or "joined" (split, and two stacked dots per
# stripe instead of four: _intra_scores_bwd_joined). Read per backward call.
B3B_FORM_ENV, B3B_FORM = "MOESTACK_KDA_B3B_FORM", ("split", "masked", "narrow", "joined")


def bwd_x_choice(bwd_x: str | None = None) -> str:
    """The argument, else $MOESTACK_KDA_BWD_X, else "saved" (see BWD_X_ENV above)."""
    return _named_choice(bwd_x, BWD_X_ENV, BWD_X, "bwd_x")


def b3b_form_choice(form: str | None = None) -> str:
    """The argument, else $MOESTACK_KDA_B3B_FORM, else "split" (see B3B_FORM_ENV above)."""
    return _named_choice(form, B3B_FORM_ENV, B3B_FORM, "b3b_form")


def bwd_dots_choice(bwd_dots: str | None = None, bwd_x: str = "saved") -> str:
    """The argument, else $MOESTACK_KDA_BWD_DOTS, else "wy" ("tf32" with bwd_x = "recompute"; see BWD_DOTS_ENV
    above). A bf16 choice on the recompute-X path is a ValueError naming the fix."""
    if bwd_x == "recompute" and not (bwd_dots or os.environ.get(BWD_DOTS_ENV)):
        return "tf32"  # the default "wy" presumes saved X
    dots = _named_choice(bwd_dots, BWD_DOTS_ENV, BWD_DOTS, "bwd_dots")
    if bwd_x == "recompute" and dots != "tf32":
        raise ValueError(f"MOESTACK_KDA_BWD_DOTS={dots} needs MOESTACK_KDA_BWD_X=saved (bf16 dots on the recompute-X "
                         "path gave NaN on the H200): unset MOESTACK_KDA_BWD_X or set MOESTACK_KDA_BWD_DOTS=tf32")
    return dots


def _fixed_config(env: str, names: tuple, sizes: tuple) -> dict | None:
    """{name: size, ..., "num_warps": w[, "maxnreg": r]} from $env ("size:...:warps[:maxnreg]"), None when unset.
    maxnreg caps the registers per thread (64..255): e.g. 168 at 4 warps lets three CTAs share an SM."""
    spec = os.environ.get(env)
    if not spec:
        return None
    try:
        vals = [int(x) for x in spec.split(":")]
    except ValueError:
        vals = []
    n = len(names)
    reg = vals[n + 1] if len(vals) == n + 2 else None
    if (len(vals) not in (n + 1, n + 2) or any(v not in sizes for v in vals[:n]) or vals[n] not in (2, 4, 8, 16)
            or (reg is not None and not 64 <= reg <= 255)):
        raise ValueError(f"${env}={spec!r} must be '{':'.join(names)}:warps[:maxnreg]' with sizes in {sizes}, "
                         "warps 2/4/8/16, maxnreg 64..255, e.g. '" + ":".join(["32"] * n) + ":4'")
    return {**dict(zip(names, vals[:n])), "num_warps": vals[n], **({"maxnreg": reg} if reg else {})}


def kda_bwd_recurrence(intra: dict, do, dht, chunk_offsets, cu_seqlens, *, n_seqs: int, V: int,
                       need_dh0: bool):
    """Reverse recurrence. Returns (dh [NC, H, K, V], dd [T, H, V], dh0 [N, H, K, V] fp32 or None)."""
    w = intra["w"]
    T, H, K = w.shape
    NC = intra["gl"].shape[0]
    dh = w.new_empty(NC, H, K, V)
    dd = w.new_empty(T, H, V)
    dh0 = w.new_empty(n_seqs, H, K, V, dtype=torch.float32) if need_dh0 else None
    dummy = w.new_empty(1)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), n_seqs, H)

    kda_bwd_kernel_recurrence[grid](
        intra["qp"], intra["kd"], w, intra["aqk"], intra["gl"], do, dummy if dht is None else dht,
        chunk_offsets, cu_seqlens,
        dh, dd, dummy if dh0 is None else dh0,
        H,
        K=K, V=V, BT=BT, BK=triton.next_power_of_2(K), HAS_DHT=dht is not None, STORE_DH0=need_dh0,
    )
    return dh, dd, dh0


def kda_bwd_wy(k, v, beta, intra: dict, chunk_map, cu_seqlens, h, dh, d, dd, do, *, beta_sigmoid: bool,
               lowp: bool = False):
    """Backward part 1. Returns dv, dbeta (like v, beta) and the fp32 partials for part 2 (a dict). Reads X, Akk
    and W from `intra` when it has "xinv" (kda_fwd_intra(store_x=True)), else recomputes X and Akk. lowp: bf16
    operands for the WY dots."""
    T, H, K = k.shape
    V = v.shape[-1]
    NC = chunk_map.shape[0]
    dv, dbeta = torch.empty_like(v), torch.empty_like(beta)
    f32 = dict(dtype=torch.float32)
    part = dict(
        p_dqp=k.new_empty(T, H, K, **f32), p_dkd=k.new_empty(T, H, K, **f32), p_dkp=k.new_empty(T, H, K, **f32),
        p_da=k.new_empty(T, H, BT, **f32), p_dn=k.new_empty(T, H, BT, **f32), p_dbl=k.new_empty(NC, H, K, **f32),
    )
    kern, extra = kda_bwd_kernel_wy, {}
    choice = _fixed_config(B3A_ENV, ("BV", "BKS"), (16, 32, 64))
    if choice is None and (lowp or "xinv" in intra):  # the GPU-validated config (bf16 at 32:32:8 went NaN, H200)
        choice = B3A_DEFAULT
    if choice is not None:  # a fixed config: the plain jit function under the autotuner
        kern, extra = getattr(kern, "fn", kern), {**choice, "num_stages": 1}
    load_x = "xinv" in intra
    kern[(NC, H)](
        k, v, beta, intra["gc"], intra["rk"], intra["flag"], chunk_map, cu_seqlens,
        h, dh, d, dd, do, intra.get("xinv", dd), intra.get("akk", dd), intra["w"],
        dv, dbeta, *part.values(),
        H,
        K=K, V=V, BT=BT, SUB=SUB, BK=triton.next_power_of_2(K), BETA_SIGMOID=beta_sigmoid, LOAD_X=load_x,
        LOWP=lowp, **extra,
    )
    return dv, dbeta, part


def kda_bwd_scores(q, k, g, A_log, dt_bias, intra: dict, chunk_map, cu_seqlens, part: dict, *, scale: float,
                   gate: int, lower_bound: float, l2norm: bool, lowp: bool = False, form: str | None = None):
    """Backward part 2 (consumes `part`). Returns dq, dk, dg (like q, k, g) and the per-chunk partials
    pd_dt [NC, H, K] / pd_alog [NC, H] fp32 (None when the gate is not fused). lowp: bf16 dot operands;
    form: see b3b_form_choice."""
    T, H, K = q.shape
    NC = chunk_map.shape[0]
    dq, dk, dg = (torch.empty_like(x) for x in (q, k, g))
    fused_gate = gate != 0
    pd_dt = q.new_empty(NC, H, K, dtype=torch.float32) if fused_gate else None
    pd_alog = q.new_empty(NC, H, dtype=torch.float32) if fused_gate else None
    dummy = q.new_empty(1, dtype=torch.float32)
    kern, extra = kda_bwd_kernel_scores, {}
    form = b3b_form_choice(form)
    choice = _fixed_config(B3B_ENV, ("BKC",), (16, 32, 64))
    if choice is None and (lowp or form == "split"):  # the GPU-validated (and fastest measured) config
        choice = B3B_DEFAULT
    if choice is not None:
        kern, extra = getattr(kern, "fn", kern), {**choice, "num_stages": 1}
    # masked: one launch, all chunks; split / narrow: the fast chunks, then the exact-path ones (masked form; with
    # BWD_DOTS=bf16 that launch still takes tf32 dots at B3B_EXACT_CONFIG: the bf16 masked form faulted at 4 warps
    # on the H200 in session 3, and the launch only does work for the rare chunks with gates beyond SPAN_MAX)
    launches = [(0, False)] if form == "masked" else [(1, form), (2, "masked")]
    for sel, f in launches:
        if sel == 2 and lowp:
            kern = getattr(kda_bwd_kernel_scores, "fn", kda_bwd_kernel_scores)
            extra, lowp = {**B3B_EXACT_CONFIG, "num_stages": 1}, False
        kern[(NC, H)](
            q, k, g, dummy if A_log is None else A_log, dummy if dt_bias is None else dt_bias,
            intra["gc"], intra["rq"], intra["rk"], intra["flag"], chunk_map, cu_seqlens,
            *part.values(),
            dq, dk, dg, dummy if pd_dt is None else pd_dt, dummy if pd_alog is None else pd_alog,
            scale, H,
            K=K, BT=BT, SUB=SUB, GATE=gate, LOWER_BOUND=lower_bound, HAS_DT_BIAS=dt_bias is not None,
            L2NORM=l2norm, LOWP=lowp, NARROW=f == "narrow", JOIN=f == "joined", SEL=sel, **extra,
        )
    return dq, dk, dg, pd_dt, pd_alog


def kda_bwd_intra(q, k, v, g, beta, A_log, dt_bias, intra: dict, chunk_map, cu_seqlens, h, dh, d, dd, do, *,
                  scale: float, gate: int, lower_bound: float, l2norm: bool, beta_sigmoid: bool,
                  bwd_dots: str | None = None):
    """Intra-chunk gradients: kda_bwd_wy then kda_bwd_scores (fp32 partials in between: 2 KB per token and head
    at K = 128, freed on return). `intra` is kda_fwd_intra's output (with xinv / akk: B3a reads X instead of
    recomputing it). bwd_dots: see bwd_dots_choice. Returns dq, dk, dv, dg, dbeta, pd_dt, pd_alog."""
    dots = bwd_dots_choice(bwd_dots)
    lowp = dots == "bf16"
    dv, dbeta, part = kda_bwd_wy(k, v, beta, intra, chunk_map, cu_seqlens, h, dh, d, dd, do,
                                 beta_sigmoid=beta_sigmoid, lowp=dots in ("wy", "bf16"))
    dq, dk, dg, pd_dt, pd_alog = kda_bwd_scores(q, k, g, A_log, dt_bias, intra, chunk_map, cu_seqlens, part,
                                                scale=scale, gate=gate, lower_bound=lower_bound, l2norm=l2norm,
                                                lowp=lowp)
    return dq, dk, dv, dg, dbeta, pd_dt, pd_alog
