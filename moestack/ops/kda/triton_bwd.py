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
    _gc_row,
    _load_gate,
    _row,
    _state_ptr,
    _stripe_factors,
    _tok_ptr,
    _tok_ptr_t,
)
from moestack.ops.launch import prune_recurrence


# First (the single config without autotuning): BV = 32 at 8 warps compiles without spills at K = V = 128
# (ptxas, sm_90); 4 warps spill 0.5-0.7 KB per thread.
@triton.autotune(configs=_configs([
    triton.Config({"BV": 32}, num_warps=8, num_stages=2),
    triton.Config({"BV": 64}, num_warps=8, num_stages=2),
    triton.Config({"BV": 32}, num_warps=4, num_stages=2),
    triton.Config({"BV": 64}, num_warps=4, num_stages=2),
]), key=["K", "V"], prune_configs_by={"early_config_prune": prune_recurrence})
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
def _intra_scores_bwd(b_q, b_k, b_b, p_gc, n, stride, ncol, b_da, b_dn, slow, b_dq, b_dk, b_db,
                      BT: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr):
    """Add the gradients through Aqk (dA, lower incl.) and Akk (dN = d Akk, strictly lower) to dq~, dk and db.

    Every score term is x_i exp(b_i - b_j) y_j, so its log-decay gradient is x_i dx_i at row i minus y_j dy_j at j.
    fp32 (tf32) dot operands: the gate gradient is a difference of such terms that cancel, and bf16 operands put
    it at 4-5e-2 relative RMS against fp64 (README.md).
    """
    b_da_t, b_dn_t = tl.trans(b_da), tl.trans(b_dn)
    for c in range(BT // SUB):  # a runtime loop: one copy of the body (smem, compile time)
        r = _gc_row(p_gc, c * SUB + SUB - 1, n, stride, ncol, BK)
        e_l, e_r = _stripe_factors(b_b, r, c, slow, BT, SUB)
        b_kr = b_k * e_r
        b_t = e_l * tl.dot(b_da, b_kr)
        b_dq += b_t
        b_db += b_q * b_t
        b_t = e_l * tl.dot(b_dn, b_kr)
        b_dk += b_t
        b_db += b_k * b_t
        b_t = e_r * (tl.dot(b_da_t, b_q * e_l) + tl.dot(b_dn_t, b_k * e_l))
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


# One fixed launch config (B3A_CONFIG below): the others tried gave NaN with bf16 dots on the H200 (README.md).
@triton.jit
def kda_bwd_kernel_wy(
    k, v, beta, gc, rk, chunk_map, cu_seqlens,
    h, dh, d, dd, do, xinv, akk, w,
    dv, dbeta, p_dqp, p_dkd, p_dkp, p_da, p_dn, p_dbl,
    H,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BKS: tl.constexpr, BETA_SIGMOID: tl.constexpr, LOWP: tl.constexpr,
):
    """Backward, part 1 of 2, one program per (chunk slot, head): the contractions over V and the WY form.

    Writes dv and dbeta (final) and, as fp32 partials for kda_bwd_kernel_scores: dQp = dO S^T, dKd = D dS'^T,
    dKp = Diag(beta) X^T dW ([T, H, K]); dAqk and d(Diag(beta) Akk) ([T, H, BT]); exp(b_last) rowsum(S dS')
    ([NC, H, K]). Reads Akk, X = (I + Diag(beta) Akk)^-1 (xinv, akk) and W (w) as the intra kernel wrote them;
    the WY dots take LOWP_DT (bf16) operands with LOWP (low-precision inputs), else fp32 ones.
    """
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, t_end = _chunk_coords(chunk_map, cu_seqlens, i_c, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t = (t0 + o_t) < t_end
    n = t_end - t0
    DT = h.dtype.element_ty
    if LOWP:
        WY_DT = LOWP_DT
    else:
        WY_DT = tl.float32

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

    # Pass 2: Akk and X = (I + Diag(beta) Akk)^-1 read back, then dW = -dD S^T, dU = dD through WY.
    b_bl = _gc_row(gc + (t0.to(tl.int64) * H + i_h) * K, BT - 1, n, H * K, K, BK)
    tl.store(p_dbl + (i_c * H + i_h).to(tl.int64) * K + o_k, tl.exp(b_bl) * b_dsl, mask=o_k < K)
    b_beta = tl.load(beta + (t0 + o_t).to(tl.int64) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b_beta = tl.where(m_t, tl.sigmoid(b_beta), 0.0)
    # padded rows read as 0 (the forward's are identity rows of X): they only ever meet zero rows
    b_akk = tl.load(_tok_ptr(akk, t0, n, H, i_h, BT, BT, BT), boundary_check=(0, 1),
                    padding_option="zero").to(tl.float32)
    b_minv = tl.load(_tok_ptr(xinv, t0, n, H, i_h, BT, BT, BT), boundary_check=(0, 1), padding_option="zero")
    b_minv_d = b_minv.to(WY_DT)
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
        b_ddf = b_ddv.to(WY_DT)
        b_gm += tl.dot(b_ddf, tl.trans((b_beta[:, None] * b_v).to(WY_DT)))
        b_dyv = tl.dot(b_minv_t, b_ddf)  # X^T dU
        tl.store(_tok_ptr(dv, t0, n, H, i_h, V, BT, BV, i_v * BV), (b_beta[:, None] * b_dyv).to(dv.dtype.element_ty),
                 boundary_check=(0, 1))
        b_dbeta += tl.sum(b_dyv * b_v, 1)
    # WY form: W = X Diag(beta) (k exp(b)), U = X Diag(beta) v; dN = -StrictTril(X^T dW W^T + X^T dU U^T).
    # The K-wide part goes by channel blocks (registers): dD S^T is parked in p_dkp, whose block c is then read
    # and overwritten by Diag(beta) X^T dW.
    tl.store(_tok_ptr(p_dkp, t0, n, H, i_h, K, BT, BK), b_dsw, boundary_check=(0, 1))
    tl.debug_barrier()
    b_dn = tl.dot(tl.dot(b_minv_t, b_gm.to(WY_DT)).to(WY_DT), tl.trans(b_minv_d))
    b_rk = tl.load(rk + (t0 + o_t).to(tl.int64) * H + i_h, mask=m_t, other=0.0)
    for col0 in range(0, K, BKS):
        p_c = _tok_ptr(p_dkp, t0, n, H, i_h, K, BT, BKS, col0)
        b_dsw_c = tl.load(p_c, boundary_check=(0, 1), padding_option="zero")
        b_b = tl.load(_tok_ptr(gc, t0, n, H, i_h, K, BT, BKS, col0), boundary_check=(0, 1), padding_option="zero")
        b_kp = tl.load(_tok_ptr(k, t0, n, H, i_h, K, BT, BKS, col0), boundary_check=(0, 1),
                       padding_option="zero").to(tl.float32) * b_rk[:, None] * tl.exp(b_b)  # 0 on padded rows
        b_dyk = -tl.dot(b_minv_t, b_dsw_c.to(WY_DT))  # X^T dW
        b_dbeta += tl.sum(b_dyk * b_kp, 1)
        # W = X Diag(beta) (k exp(b)) as the forward stored it
        b_w = tl.load(_tok_ptr(w, t0, n, H, i_h, K, BT, BKS, col0), boundary_check=(0, 1),
                      padding_option="zero").to(tl.float32)
        b_dn += tl.dot(b_dyk.to(WY_DT), tl.trans(b_w.to(WY_DT)))  # (X^T dW) W^T
        tl.debug_barrier()  # every thread has read block c before it is overwritten
        tl.store(p_c, b_beta[:, None] * b_dyk, boundary_check=(0, 1))
    b_dn = tl.where(o_t[:, None] > o_t[None, :], -b_dn, 0.0)  # d(Diag(beta) Akk)
    b_dbeta += tl.sum(b_dn * b_akk, 1)
    tl.store(_tok_ptr(p_dn, t0, n, H, i_h, BT, BT, BT), b_beta[:, None] * b_dn, boundary_check=(0, 1))
    if BETA_SIGMOID:
        b_dbeta = b_dbeta * b_beta * (1.0 - b_beta)
    tl.store(dbeta + (t0 + o_t).to(tl.int64) * H + i_h, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)


# One fixed launch config (B3B_CONFIG below); it parks d q_hat, d k_hat in p_dqp / p_dkd (read by the same program
# before), so it is never autotuned (a benchmark run would leave them overwritten).
@triton.jit
def kda_bwd_kernel_scores(
    q, k, g, A_log, dt_bias, gc, rq, rk, flag, chunk_map, cu_seqlens,
    p_dqp, p_dkd, p_dkp, p_da, p_dn, p_dbl,
    dq, dk, dg, pd_dt, pd_alog,
    scale, H,
    K: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr, BKC: tl.constexpr,
    GATE: tl.constexpr, LOWER_BOUND: tl.constexpr, HAS_DT_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    SEL: tl.constexpr,
):
    """Backward, part 2 of 2, one program per (chunk slot, head), BKC channels at a time (all of this is
    per channel except the L2-norm rows): gradients through Aqk, Akk, Qp, Kd and W's k exp(b), the cumsum, the
    gate and the L2 norm. Writes dq, dk, dg and the per-chunk dt_bias / A_log partials (pd_dt, pd_alog).
    Two launches as in the intra kernel: SEL 1 the chunks of the factorised form (the exact path compiled out:
    ptxas spills 288 -> 0 B), SEL 2 the chunks flagged for the exact path."""
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
    else:  # the chunks flagged for the exact path only
        if not slow:
            return
    b_rq = tl.load(rq + (t0 + o_t).to(tl.int64) * H + i_h, mask=m_t, other=0.0)
    b_rk = tl.load(rk + (t0 + o_t).to(tl.int64) * H + i_h, mask=m_t, other=0.0)
    b_da = tl.load(_tok_ptr(p_da, t0, n, H, i_h, BT, BT, BT), boundary_check=(0, 1), padding_option="zero")
    b_dn = tl.load(_tok_ptr(p_dn, t0, n, H, i_h, BT, BT, BT), boundary_check=(0, 1), padding_option="zero")

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
        b_dq_, b_dk_, b_db = _intra_scores_bwd(b_q, b_k, b_b, p_gc, n, H * K, K - col0, b_da, b_dn, slow,
                                               b_dq_, b_dk_, b_db, BT, SUB, BKC)
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


B3A_CONFIG = {"BV": 64, "BKS": 64, "num_warps": 8, "num_stages": 1}  # B3a: BV 32 / BKS 32 with bf16 dots gave NaN
B3B_CONFIG = {"BKC": 16, "num_warps": 4, "num_stages": 1}  # B3b: the fastest measured


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


def kda_bwd_wy(k, v, beta, intra: dict, chunk_map, cu_seqlens, h, dh, d, dd, do, *, beta_sigmoid: bool):
    """Backward part 1. Returns dv, dbeta (like v, beta) and the fp32 partials for part 2 (a dict). Reads X, Akk
    and W from `intra` (kda_fwd_intra(store_x=True))."""
    T, H, K = k.shape
    V = v.shape[-1]
    NC = chunk_map.shape[0]
    dv, dbeta = torch.empty_like(v), torch.empty_like(beta)
    f32 = dict(dtype=torch.float32)
    part = dict(
        p_dqp=k.new_empty(T, H, K, **f32), p_dkd=k.new_empty(T, H, K, **f32), p_dkp=k.new_empty(T, H, K, **f32),
        p_da=k.new_empty(T, H, BT, **f32), p_dn=k.new_empty(T, H, BT, **f32), p_dbl=k.new_empty(NC, H, K, **f32),
    )
    kda_bwd_kernel_wy[(NC, H)](
        k, v, beta, intra["gc"], intra["rk"], chunk_map, cu_seqlens,
        h, dh, d, dd, do, intra["xinv"], intra["akk"], intra["w"],
        dv, dbeta, *part.values(),
        H,
        K=K, V=V, BT=BT, BK=triton.next_power_of_2(K), BETA_SIGMOID=beta_sigmoid, LOWP=v.dtype != torch.float32,
        **B3A_CONFIG,
    )
    return dv, dbeta, part


def kda_bwd_scores(q, k, g, A_log, dt_bias, intra: dict, chunk_map, cu_seqlens, part: dict, *, scale: float,
                   gate: int, lower_bound: float, l2norm: bool):
    """Backward part 2 (consumes `part`). Returns dq, dk, dg (like q, k, g) and the per-chunk partials
    pd_dt [NC, H, K] / pd_alog [NC, H] fp32 (None when the gate is not fused)."""
    T, H, K = q.shape
    NC = chunk_map.shape[0]
    dq, dk, dg = (torch.empty_like(x) for x in (q, k, g))
    fused_gate = gate != 0
    pd_dt = q.new_empty(NC, H, K, dtype=torch.float32) if fused_gate else None
    pd_alog = q.new_empty(NC, H, dtype=torch.float32) if fused_gate else None
    dummy = q.new_empty(1, dtype=torch.float32)
    for sel in (1, 2):  # the fast chunks, then the exact-path ones
        kda_bwd_kernel_scores[(NC, H)](
            q, k, g, dummy if A_log is None else A_log, dummy if dt_bias is None else dt_bias,
            intra["gc"], intra["rq"], intra["rk"], intra["flag"], chunk_map, cu_seqlens,
            *part.values(),
            dq, dk, dg, dummy if pd_dt is None else pd_dt, dummy if pd_alog is None else pd_alog,
            scale, H,
            K=K, BT=BT, SUB=SUB, GATE=gate, LOWER_BOUND=lower_bound, HAS_DT_BIAS=dt_bias is not None,
            L2NORM=l2norm, SEL=sel, **B3B_CONFIG,
        )
    return dq, dk, dg, pd_dt, pd_alog


def kda_bwd_intra(q, k, v, g, beta, A_log, dt_bias, intra: dict, chunk_map, cu_seqlens, h, dh, d, dd, do, *,
                  scale: float, gate: int, lower_bound: float, l2norm: bool, beta_sigmoid: bool):
    """Intra-chunk gradients: kda_bwd_wy then kda_bwd_scores (fp32 partials in between: 2 KB per token and head
    at K = 128, freed on return). `intra` is kda_fwd_intra(store_x=True)'s output. Returns dq, dk, dv, dg, dbeta,
    pd_dt, pd_alog."""
    dv, dbeta, part = kda_bwd_wy(k, v, beta, intra, chunk_map, cu_seqlens, h, dh, d, dd, do,
                                 beta_sigmoid=beta_sigmoid)
    dq, dk, dg, pd_dt, pd_alog = kda_bwd_scores(q, k, g, A_log, dt_bias, intra, chunk_map, cu_seqlens, part,
                                                scale=scale, gate=gate, lower_bound=lower_bound, l2norm=l2norm)
    return dq, dk, dv, dg, dbeta, pd_dt, pd_alog
