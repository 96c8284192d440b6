"""KDA forward in Triton: a fused intra-chunk kernel and a fused state-recurrence + output kernel.

Chunk C = BT = 64 tokens, log-space gates. Per (chunk, head) the intra kernel reads the raw inputs once and does
all the elementwise work in registers: gate activation (K3 or Kimi Linear form, or an already-activated
log-decay), chunk-local cumsum, q/k L2 normalisation, beta sigmoid; then the decayed score matrices, the unit
lower-triangular inverse and the WY products. The recurrence kernel walks the chunks of one sequence per
(head, V-block) program, keeps the state in registers and writes the output directly (no per-chunk state is
stored unless backward asks for it). The math and the save/recompute policy are in README.md.

Shape legend: T tokens (all sequences packed), H heads, K key dim, V value dim, BT chunk rows (64),
BK/BV padded tile widths, NC chunk slots (an upper bound on the number of chunks), N sequences.
Per chunk, with b = cumsum of the log-decay inside the chunk (b <= 0, non-increasing), q~ = scale * q_hat:
    Akk[i, j] = sum_d k_id k_jd exp(b_id - b_jd)   (i > j)        N = Diag(beta) Akk,  X = (I + N)^-1
    Aqk[i, j] = sum_d q~_id k_jd exp(b_id - b_jd)  (i >= j)
    W = X Diag(beta) (k * exp(b)),  U = X Diag(beta) v,  Qp = q~ * exp(b),  Kd = k * exp(b_last - b)
and across chunks (state S [K, V] entering the chunk):
    D = U - W S ;  O = Qp S + Aqk D ;  S' = Diag(exp(b_last)) S + Kd^T D
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moestack.ops.launch import prune_recurrence

BT = 64  # chunk size: rows of every intra-chunk tile
SUB = 16  # rows of a diagonal sub-block; each has its own reference point for the exp factorisation
# Largest log-decay span inside a 16-row sub-block for which the factorised exp is exact in fp32
# (factors stay within e^+-80, fp32 reaches e^88). Chunks beyond it take the exact per-column path.
SPAN_MAX = 80.0
GATE_NONE, GATE_K3, GATE_KIMI = 0, 1, 2
# Matmul precision of the triangular inverse X (it feeds W, U and every gradient): X to ~1e-4 relative for
# independent keys, ~1e-3 for strongly correlated ones (cos 0.8-0.9; torch simulation), and no register spills in
# K1 / B3a (tf32x3 was ~fp32 accurate with ~0.3 KB of spills per thread).
INV_PRECISION = tl.constexpr("tf32")
# K1's one launch config (BKS, warps): with bf16 score / WY dots the fastest measured, and the one every GPU test
# ran. README.md "Triton kernels" has the measured alternatives.
K1_CONFIG = {"BKS": 32, "num_warps": 4}

# Without a GPU the kernels run only through Triton's interpreter, which is chosen when a kernel is decorated:
# TRITON_INTERPRET=1 must be set before this module is imported (the CPU tests do; it stays on for the process).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Operands of K1's score dots (Akk, Aqk) and WY dots (W = X.., U = X..) and of B3a's WY dots: bf16 (fp32
# accumulate: half the shared-memory staging, twice the tensor-core rate; the decay factors are <= 1 off the diagonal
# sub-blocks, so only mantissa bits are lost). The interpreter's bf16 dot is broken (NaN), so there the same code
# runs in fp16; the CPU tests set this to fp32 to check the kernels' logic exactly (a global read per call under the
# interpreter), the GPU tests check the bf16 precision.
LOWP_DT = tl.constexpr(tl.float16 if INTERPRET else tl.bfloat16)


def _configs(configs: list[triton.Config]) -> list[triton.Config]:
    """Autotune candidates: the first only under the interpreter (autotuning needs a GPU); on a GPU all of them,
    pruned at launch against the device's shared memory (moestack/ops/launch.py, which also keeps only the first
    that fits when KernelSpec.autotune is off)."""
    return configs[:1] if INTERPRET else configs


# ---- shared jit helpers (also used by triton_bwd) ------------------------------------------------------------


@triton.jit
def _tok_ptr(x, t0, n_rows, H, i_h, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, col0=0):
    """Block pointer to a [BR, BD] tile of the token-major tensor x [T, H, D] (rows t0.., head i_h, cols col0..).
    Rows past n_rows and columns past D read as zeros and are not written (boundary_check=(0, 1))."""
    return tl.make_block_ptr(x + (t0.to(tl.int64) * H + i_h) * D, (n_rows, D), (H * D, 1), (0, col0), (BR, BD), (1, 0))


@triton.jit
def _tok_ptr_t(x, t0, n_rows, H, i_h, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """Like _tok_ptr, transposed: a [BD, BR] tile (x^T), loaded without a register transpose."""
    return tl.make_block_ptr(x + (t0.to(tl.int64) * H + i_h) * D, (D, n_rows), (1, H * D), (0, 0), (BD, BR), (0, 1))


@triton.jit
def _state_ptr(x, i_s, H, i_h, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, col0):
    """Block pointer to the [BK, BV] tile (cols col0..) of state i_s of x [S, H, K, V]."""
    return tl.make_block_ptr(x + (i_s * H + i_h).to(tl.int64) * K * V, (K, V), (V, 1), (0, col0), (BK, BV), (1, 0))


@triton.jit
def _gate_fwd(b_x, a, GATE: tl.constexpr, LOWER_BOUND: tl.constexpr):
    """Log-decay from the gate input b_x (dt_bias already added); a = exp(A_log) of this head."""
    if GATE == 1:
        b_g = LOWER_BOUND * tl.sigmoid(a * b_x)
    elif GATE == 2:
        b_g = -a * (tl.maximum(b_x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(b_x))))  # -a * softplus, stable
    else:
        b_g = b_x
    return b_g


@triton.jit
def _row(b_x, i, BT: tl.constexpr):
    """Row i of a [BT, X] register tile, as [X]."""
    return tl.sum(tl.where((tl.arange(0, BT) == i)[:, None], b_x, 0.0), 0)


@triton.jit
def _gc_row(p_gc, row, n, stride, ncol, BK: tl.constexpr):
    """Row `row` [BK] of the chunk's cumulative log-decay b, read back from memory (a register tile has no cheap
    row access). p_gc points at the chunk's first row and first column; rows past the n valid ones repeat the
    last valid row, as padded rows (g = 0) do."""
    r = tl.maximum(tl.minimum(row, n - 1), 0)
    o_k = tl.arange(0, BK)
    return tl.load(p_gc + r.to(tl.int64) * stride + o_k, mask=o_k < ncol, other=0.0)


@triton.jit
def _max_span(p_gc, n, stride, ncol, BT: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr):
    """Largest log-decay across a 16-row sub-block, over all sub-blocks and channels (a scalar)."""
    span = tl.zeros([BK], tl.float32)
    for c in tl.static_range(BT // SUB):
        span = tl.maximum(span, _gc_row(p_gc, c * SUB, n, stride, ncol, BK)
                          - _gc_row(p_gc, c * SUB + SUB - 1, n, stride, ncol, BK))
    return tl.max(span, 0)


@triton.jit
def _load_gate(g, dt_bias, A_log, i_h, t0, t_end, H, col0,
               K: tl.constexpr, BT: tl.constexpr, BKC: tl.constexpr,
               GATE: tl.constexpr, LOWER_BOUND: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """Gate input x (+ dt_bias) and log-decay g [BT, BKC] of columns col0..; padded rows and columns have g = 0."""
    o_t = tl.arange(0, BT)
    o_k = col0 + tl.arange(0, BKC)
    m_tk = ((t0 + o_t) < t_end)[:, None] & (o_k < K)[None, :]
    p_x = _tok_ptr(g, t0, t_end - t0, H, i_h, K, BT, BKC, col0)
    b_x = tl.load(p_x, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    if HAS_DT_BIAS:
        b_x += tl.load(dt_bias + i_h * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)[None, :]
    if GATE != 0:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    else:
        a = 1.0
    return b_x, tl.where(m_tk, _gate_fwd(b_x, a, GATE, LOWER_BOUND), 0.0)


@triton.jit
def _stripe_factors(b_b, r, c, slow, BT: tl.constexpr, SUB: tl.constexpr):
    """exp factors for column stripe c (columns c*SUB .. c*SUB+SUB-1); r [BK] = b at the stripe's last row.

    e_l [BT, BK] = exp(b_i - r) for rows i at/below the stripe (strictly below when slow), else 0;
    e_r [BT, BK] = exp(r - b_j) for rows j inside the stripe, else 0. Both are <= 1 off the diagonal block and
    within e^+-SPAN_MAX on it, so e_l[i] * e_r[j] = exp(b_i - b_j) without overflow.
    """
    o_t = tl.arange(0, BT)
    lo = c * SUB + tl.where(slow, SUB, 0)
    m_l = (o_t >= lo)[:, None]
    m_r = ((o_t >= c * SUB) & (o_t < c * SUB + SUB))[:, None]
    e_l = tl.where(m_l, tl.exp(tl.where(m_l, b_b - r[None, :], 0.0)), 0.0)
    e_r = tl.where(m_r, tl.exp(tl.where(m_r, r[None, :] - b_b, 0.0)), 0.0)
    return e_l, e_r


@triton.jit
def _exact_diag_factor(b_b, j, BT: tl.constexpr, SUB: tl.constexpr, STRICT: tl.constexpr):
    """exp(b_i - b_j) [BT, BK] for rows i in j's sub-block with i >= j (i > j if STRICT), else 0. Exponents <= 0."""
    o_t = tl.arange(0, BT)
    b_j = _row(b_b, j, BT)
    if STRICT:
        m = ((o_t // SUB) == (j // SUB)) & (o_t > j)
    else:
        m = ((o_t // SUB) == (j // SUB)) & (o_t >= j)
    return tl.where(m[:, None], tl.exp(tl.where(m[:, None], b_b - b_j[None, :], 0.0)), 0.0)


@triton.jit
def _intra_scores(b_q, b_k, b_b, p_gc, n, stride, ncol, slow,
                  BT: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, LOWP: tl.constexpr):
    """Akk (strictly lower) and Aqk (lower incl. diagonal), [BT, BT] fp32. b_b [BT, BK] is the chunk's cumulative
    log-decay, also readable by rows at p_gc (see _gc_row). LOWP: low-precision dot operands (LOWP_DT)."""
    o_t = tl.arange(0, BT)
    b_akk = tl.zeros([BT, BT], tl.float32)
    b_aqk = tl.zeros([BT, BT], tl.float32)
    for c in range(BT // SUB):  # a runtime loop: one copy of the body (smem, compile time)
        r = _gc_row(p_gc, c * SUB + SUB - 1, n, stride, ncol, BK)
        e_l, e_r = _stripe_factors(b_b, r, c, slow, BT, SUB)
        b_kr = b_k * e_r
        if LOWP:
            b_krt = tl.trans(b_kr.to(LOWP_DT))
            b_akk += tl.dot((b_k * e_l).to(LOWP_DT), b_krt)
            b_aqk += tl.dot((b_q * e_l).to(LOWP_DT), b_krt)
        else:
            b_akk += tl.dot(b_k * e_l, tl.trans(b_kr))
            b_aqk += tl.dot(b_q * e_l, tl.trans(b_kr))
    if slow:
        # Exact diagonal sub-blocks, one column at a time (only for gates too strong for the factorisation).
        for j in range(BT):
            b_ke = _exact_diag_factor(b_b, j, BT, SUB, False) * _row(b_k, j, BT)[None, :]
            put = (o_t == j)[None, :]
            b_akk += tl.where(put, tl.sum(b_k * b_ke, 1)[:, None], 0.0)
            b_aqk += tl.where(put, tl.sum(b_q * b_ke, 1)[:, None], 0.0)
    b_akk = tl.where(o_t[:, None] > o_t[None, :], b_akk, 0.0)
    b_aqk = tl.where(o_t[:, None] >= o_t[None, :], b_aqk, 0.0)
    return b_akk, b_aqk


@triton.jit
def _unit_lower_inverse(b_n, BT: tl.constexpr):
    """(I + N)^-1 for strictly lower N [BT, BT] (BT = 64), by recursive block doubling: with Y the inverse's
    diagonal blocks of size s, the blocks of size 2s are Y - Y C Y, C = N's lower-left s-blocks inside each 2s
    block. 2 matmuls per level after the first, 10 in all.

    Why not the power series (I - N)(I + N^2)...(I + N^32): for correlated keys (cos ~0.5-0.9, as after SiLU)
    and beta ~1 the powers N^p reach ~1e9 with alternating signs while the inverse stays O(1); fp32 / tf32 lose
    every digit (an in-model NaN). Here every intermediate is a block of the true inverse."""
    o_t = tl.arange(0, BT)
    row, col = o_t[:, None], o_t[None, :]
    b_y = tl.where(row == col, 1.0, 0.0) - tl.where((row // 2 == col // 2) & (row > col), b_n, 0.0)
    s = 2
    for _ in range(5):  # s = 2, 4, 8, 16, 32
        m_c = (row // s == col // s + 1) & ((col // s) % 2 == 0)
        b_t = tl.dot(b_y, tl.where(m_c, b_n, 0.0), input_precision=INV_PRECISION)
        b_y = b_y - tl.dot(b_t, b_y, input_precision=INV_PRECISION)
        s = s * 2
    return b_y


@triton.jit
def _chunk_coords(chunk_map, cu_seqlens, i_c, BT: tl.constexpr):
    """(sequence, first token, end of valid rows) of chunk slot i_c; a dead slot gets no valid rows."""
    i_n = tl.load(chunk_map + i_c * 2)
    i_j = tl.load(chunk_map + i_c * 2 + 1)
    live = i_n >= 0
    i_n = tl.maximum(i_n, 0)
    bos = tl.load(cu_seqlens + i_n).to(tl.int32)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
    t0 = bos + tl.maximum(i_j, 0) * BT
    t_end = tl.where(live, tl.minimum(eos, t0 + BT), t0)
    return t0, t_end


@triton.jit
def _b_cols(gc, p_gc, t0, n, m_t, H, i_h, col0, K: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr):
    """Columns col0.. of the chunk's cumulative log-decay b [BT, BKS] read back from gc, padded rows repeating the
    last valid row (as the zero gates of padding would), and that last row b_last [BKS]. (A padded row at b = 0
    would put exp(b_i - r) ~ e^+300 next to its zero k: NaN.)"""
    b_bl = _gc_row(p_gc + col0, BT - 1, n, H * K, K - col0, BKS)
    b_b = tl.load(_tok_ptr(gc, t0, n, H, i_h, K, BT, BKS, col0), boundary_check=(0, 1), padding_option="zero")
    return tl.where(m_t[:, None], b_b, b_bl[None, :]), b_bl


# ---- kernels -------------------------------------------------------------------------------------------------


# One fixed launch config (K1_CONFIG): BKS (channel block) 32 at 4 warps.
@triton.jit
def kda_fwd_kernel_intra(
    q, k, v, g, beta, A_log, dt_bias, chunk_map, cu_seqlens,
    w, u, qp, kd, aqk, gl, gc, rq, rk, flag, xinv, akk,
    scale, H,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, LOWER_BOUND: tl.constexpr, HAS_DT_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    L2_EPS: tl.constexpr, BETA_SIGMOID: tl.constexpr, SPAN_MAX: tl.constexpr, BKS: tl.constexpr,
    LOWP: tl.constexpr, STORE_X: tl.constexpr, SEL: tl.constexpr,
):
    """One program per (chunk slot, head): writes W, U, Qp, Kd [T, H, *], Aqk [T, H, BT], b_last [NC, H, K],
    and for backward the cumulative log-decay b (gc [T, H, K] fp32), 1/||q||, 1/||k|| (rq, rk [T, H]) and the
    exact-path flag [NC, H]; with STORE_X also X = (I + Diag(beta) Akk)^-1 (xinv [T, H, BT] fp32) and Akk
    (akk [T, H, BT]), which the backward reads instead of recomputing them.
    Two launches: SEL 1 finishes only the chunks the factorised exp covers, with the exact path compiled out
    (registers: ptxas spills 500 -> 60 B at 32:4 bf16), the others stop after writing their flag; SEL 2 then runs
    only the flagged chunks (LOWP off: its bf16 form never ran through the GPU tests; no work when none is flagged)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    if SEL == 2:
        if tl.load(flag + i_c * H + i_h) == 0:
            return
    t0, t_end = _chunk_coords(chunk_map, cu_seqlens, i_c, BT)
    o_t = tl.arange(0, BT)
    m_t = (t0 + o_t) < t_end
    n = t_end - t0
    p_gc = gc + (t0.to(tl.int64) * H + i_h) * K
    # Everything K-wide goes by channel blocks of BKS, re-reading q, k and b (L1/L2 hits): a [BT, K] fp32 tile
    # costs 32 registers per thread at 8 warps, and the score loop keeps ~6 of them live.
    # Pass 1: gate and chunk cumsum (b, stored to gc), row norms of q and k.
    b_sq = tl.zeros([BT], tl.float32)
    b_sk = tl.zeros([BT], tl.float32)
    for col0 in range(0, K, BKS):
        b_q = tl.load(_tok_ptr(q, t0, n, H, i_h, K, BT, BKS, col0), boundary_check=(0, 1),
                      padding_option="zero").to(tl.float32)
        b_k = tl.load(_tok_ptr(k, t0, n, H, i_h, K, BT, BKS, col0), boundary_check=(0, 1),
                      padding_option="zero").to(tl.float32)
        b_sq += tl.sum(b_q * b_q, 1)
        b_sk += tl.sum(b_k * b_k, 1)
        _, b_g = _load_gate(g, dt_bias, A_log, i_h, t0, t_end, H, col0, K, BT, BKS, GATE, LOWER_BOUND, HAS_DT_BIAS)
        tl.store(_tok_ptr(gc, t0, n, H, i_h, K, BT, BKS, col0), tl.cumsum(b_g, axis=0), boundary_check=(0, 1))
    if L2NORM:
        b_rq = tl.rsqrt(b_sq + L2_EPS)
        b_rk = tl.rsqrt(b_sk + L2_EPS)
    else:
        b_rq = tl.full([BT], 1.0, tl.float32)
        b_rk = tl.full([BT], 1.0, tl.float32)
    tl.store(rq + (t0 + o_t).to(tl.int64) * H + i_h, b_rq, mask=m_t)
    tl.store(rk + (t0 + o_t).to(tl.int64) * H + i_h, b_rk, mask=m_t)
    b_beta = tl.load(beta + (t0 + o_t).to(tl.int64) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b_beta = tl.where(m_t, tl.sigmoid(b_beta), 0.0)
    tl.debug_barrier()  # b is read back below, by rows and by other threads
    span = _max_span(p_gc, n, H * K, K, BT, SUB, BK)
    slow = span > SPAN_MAX
    if SEL != 2:
        tl.store(flag + i_c * H + i_h, slow.to(tl.int32))
    if SEL == 1:
        if slow:
            return
        slow = False

    # Pass 2: Akk, Aqk; Qp = q~ exp(b), Kd = k exp(b_last - b), b_last.
    b_akk = tl.zeros([BT, BT], tl.float32)
    b_aqk = tl.zeros([BT, BT], tl.float32)
    for col0 in range(0, K, BKS):
        b_b, b_bl = _b_cols(gc, p_gc, t0, n, m_t, H, i_h, col0, K, BT, BKS)
        b_q = tl.load(_tok_ptr(q, t0, n, H, i_h, K, BT, BKS, col0), boundary_check=(0, 1),
                      padding_option="zero").to(tl.float32) * (b_rq * scale)[:, None]
        b_k = tl.load(_tok_ptr(k, t0, n, H, i_h, K, BT, BKS, col0), boundary_check=(0, 1),
                      padding_option="zero").to(tl.float32) * b_rk[:, None]
        b_a, b_aq = _intra_scores(b_q, b_k, b_b, p_gc + col0, n, H * K, K - col0, slow, BT, SUB, BKS, LOWP)
        b_akk += b_a
        b_aqk += b_aq
        tl.store(_tok_ptr(qp, t0, n, H, i_h, K, BT, BKS, col0), (b_q * tl.exp(b_b)).to(qp.dtype.element_ty),
                 boundary_check=(0, 1))
        tl.store(_tok_ptr(kd, t0, n, H, i_h, K, BT, BKS, col0),
                 (b_k * tl.exp(b_bl[None, :] - b_b)).to(kd.dtype.element_ty), boundary_check=(0, 1))
        o_kc = col0 + tl.arange(0, BKS)
        tl.store(gl + (i_c * H + i_h).to(tl.int64) * K + o_kc, b_bl, mask=o_kc < K)
    tl.store(_tok_ptr(aqk, t0, n, H, i_h, BT, BT, BT), b_aqk.to(aqk.dtype.element_ty), boundary_check=(0, 1))
    if STORE_X:  # here, not after the inverse: Akk would stay live through it (registers)
        tl.store(_tok_ptr(akk, t0, n, H, i_h, BT, BT, BT), b_akk.to(akk.dtype.element_ty), boundary_check=(0, 1))

    # Pass 3: X = (I + Diag(beta) Akk)^-1, W = X Diag(beta) (k exp(b)), U = X Diag(beta) v.
    b_minv = _unit_lower_inverse(b_beta[:, None] * b_akk, BT)
    if STORE_X:
        tl.store(_tok_ptr(xinv, t0, n, H, i_h, BT, BT, BT), b_minv, boundary_check=(0, 1))
    if LOWP:
        b_minv_d = b_minv.to(LOWP_DT)
    else:
        b_minv_d = b_minv
    _k1_wy(k, v, w, u, gc, p_gc, t0, n, m_t, H, i_h, b_minv_d, b_rk, b_beta, K, V, BT, BKS, LOWP)


@triton.jit
def _k1_wy(k, v, w, u, gc, p_gc, t0, n, m_t, H, i_h, b_minv_d, b_rk, b_beta, K: tl.constexpr, V: tl.constexpr,
           BT: tl.constexpr, BKW: tl.constexpr, LOWP: tl.constexpr):
    """K1's last pass: W = X Diag(beta) (k exp(b)) and U = X Diag(beta) v by column blocks of BKW."""
    for col0 in range(0, K, BKW):
        b_b, _ = _b_cols(gc, p_gc, t0, n, m_t, H, i_h, col0, K, BT, BKW)
        b_k = tl.load(_tok_ptr(k, t0, n, H, i_h, K, BT, BKW, col0), boundary_check=(0, 1),
                      padding_option="zero").to(tl.float32) * (b_rk * b_beta)[:, None]
        b_kb = b_k * tl.exp(b_b)
        if LOWP:
            b_kb = b_kb.to(LOWP_DT)
        tl.store(_tok_ptr(w, t0, n, H, i_h, K, BT, BKW, col0), tl.dot(b_minv_d, b_kb).to(w.dtype.element_ty),
                 boundary_check=(0, 1))
    for col0 in range(0, V, BKW):
        b_v = tl.load(_tok_ptr(v, t0, n, H, i_h, V, BT, BKW, col0), boundary_check=(0, 1), padding_option="zero")
        b_bv = b_beta[:, None] * b_v.to(tl.float32)
        if LOWP:
            b_bv = b_bv.to(LOWP_DT)
        b_u = tl.dot(b_minv_d, b_bv)
        tl.store(_tok_ptr(u, t0, n, H, i_h, V, BT, BKW, col0), b_u.to(u.dtype.element_ty), boundary_check=(0, 1))


# First (the single config without autotuning): BV = 32 at 4 warps, faster than 32 / 8 although it spills (README.md,
# "Measured").
@triton.autotune(configs=_configs([
    triton.Config({"BV": 32}, num_warps=4, num_stages=2),
    triton.Config({"BV": 32}, num_warps=8, num_stages=2),
    triton.Config({"BV": 64}, num_warps=8, num_stages=2),
    triton.Config({"BV": 64}, num_warps=4, num_stages=2),
]), key=["K", "V", "STORE_O", "STORE_H"], prune_configs_by={"early_config_prune": prune_recurrence})
@triton.jit
def kda_fwd_kernel_recurrence(
    w, u, qp, kd, aqk, gl, h0, chunk_offsets, cu_seqlens,
    o, ht, h, d,
    H,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_H: tl.constexpr, STORE_D: tl.constexpr,
    STORE_O: tl.constexpr,
):
    """One program per (V-block, sequence, head), sequential over the sequence's chunks.

    State S [BK, BV] fp32 in registers. Per chunk: D = U - W S; O = Qp S + Aqk D; S = exp(b_last) S + Kd^T D.
    Optionally stores the state entering each chunk (h [NC, H, K, V]) and D (d [T, H, V]) for backward.
    """
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int32)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int32)
    n_t = tl.cdiv(eos - bos, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    DT = w.dtype.element_ty  # matmul operand dtype: the storage dtype of the intermediates

    b_s = tl.zeros([BK, BV], tl.float32)
    if HAS_H0:
        p_h0 = _state_ptr(h0, i_n, H, i_h, K, V, BK, BV, i_v * BV)
        b_s += tl.load(p_h0, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    for i_j in range(0, n_t):
        t0 = bos + i_j * BT
        n = eos - t0
        i_c = c0 + i_j
        if STORE_H:
            tl.store(_state_ptr(h, i_c, H, i_h, K, V, BK, BV, i_v * BV), b_s.to(h.dtype.element_ty),
                     boundary_check=(0, 1))
        b_w = tl.load(_tok_ptr(w, t0, n, H, i_h, K, BT, BK), boundary_check=(0, 1), padding_option="zero")
        b_kdt = tl.load(_tok_ptr_t(kd, t0, n, H, i_h, K, BT, BK), boundary_check=(0, 1), padding_option="zero")
        p_u = _tok_ptr(u, t0, n, H, i_h, V, BT, BV, i_v * BV)
        b_u = tl.load(p_u, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        b_bl = tl.load(gl + (i_c * H + i_h).to(tl.int64) * K + o_k, mask=m_k, other=0.0)
        b_sd = b_s.to(DT)
        b_d = b_u - tl.dot(b_w, b_sd)
        b_dd = b_d.to(DT)
        if STORE_D:
            tl.store(_tok_ptr(d, t0, n, H, i_h, V, BT, BV, i_v * BV), b_d.to(d.dtype.element_ty),
                     boundary_check=(0, 1))
        if STORE_O:
            b_qp = tl.load(_tok_ptr(qp, t0, n, H, i_h, K, BT, BK), boundary_check=(0, 1), padding_option="zero")
            b_a = tl.load(_tok_ptr(aqk, t0, n, H, i_h, BT, BT, BT), boundary_check=(0, 1), padding_option="zero")
            b_o = tl.dot(b_qp, b_sd) + tl.dot(b_a, b_dd)
            tl.store(_tok_ptr(o, t0, n, H, i_h, V, BT, BV, i_v * BV), b_o.to(o.dtype.element_ty),
                     boundary_check=(0, 1))
        b_s = b_s * tl.exp(b_bl)[:, None] + tl.dot(b_kdt, b_dd)
    if STORE_HT:
        tl.store(_state_ptr(ht, i_n, H, i_h, K, V, BK, BV, i_v * BV), b_s, boundary_check=(0, 1))


# ---- launchers -----------------------------------------------------------------------------------------------


def kda_fwd_intra(q, k, v, g, beta, A_log, dt_bias, chunk_map, cu_seqlens, *, scale: float, gate: int,
                  lower_bound: float, l2norm: bool, beta_sigmoid: bool, inter_dtype: torch.dtype,
                  l2_eps: float = 1e-6, store_x: bool = False) -> dict:
    """Run the intra-chunk kernel. q, k, g [T, H, K]; v [T, H, V]; beta [T, H] (tokens of all sequences packed).

    chunk_map int32 [NC, 2] (sequence, chunk-in-sequence; -1 = dead slot), cu_seqlens int32 [N + 1].
    Returns dict of w, qp, kd [T, H, K], u [T, H, V], aqk [T, H, BT] (inter_dtype), gl [NC, H, K] fp32 (b of the
    chunk's last row), and for backward gc [T, H, K] fp32 (b), rq, rk [T, H] fp32 (inverse norms; 1 without the
    norm) and flag [NC, H] int32 (1 = the chunk took the exact path). store_x: also xinv [T, H, BT] fp32 (the
    chunk's X = (I + Diag(beta) Akk)^-1 by rows) and akk [T, H, BT] (inter_dtype), which the backward reads.
    """
    T, H, K = q.shape
    V = v.shape[-1]
    NC = chunk_map.shape[0]
    out = dict(
        w=q.new_empty(T, H, K, dtype=inter_dtype),
        u=q.new_empty(T, H, V, dtype=inter_dtype),
        qp=q.new_empty(T, H, K, dtype=inter_dtype),
        kd=q.new_empty(T, H, K, dtype=inter_dtype),
        aqk=q.new_empty(T, H, BT, dtype=inter_dtype),
        gl=q.new_empty(NC, H, K, dtype=torch.float32),
        gc=q.new_empty(T, H, K, dtype=torch.float32),
        rq=q.new_empty(T, H, dtype=torch.float32),
        rk=q.new_empty(T, H, dtype=torch.float32),
        flag=torch.empty(NC, H, dtype=torch.int32, device=q.device),
    )
    dummy = q.new_empty(1, dtype=torch.float32)
    if store_x:
        out["xinv"] = q.new_empty(T, H, BT, dtype=torch.float32)
        out["akk"] = q.new_empty(T, H, BT, dtype=inter_dtype)
    # The exact-path launch (sel 2: the rare chunks with gates beyond SPAN_MAX) keeps tf32 dots: its bf16 variant
    # was never validated on the GPU, and it costs nothing when no chunk is flagged. fp32 inputs keep them throughout.
    lowp = q.dtype != torch.float32
    for sel in (1, 2):
        kda_fwd_kernel_intra[(NC, H)](
            q, k, v, g, beta, dummy if A_log is None else A_log, dummy if dt_bias is None else dt_bias,
            chunk_map, cu_seqlens,
            out["w"], out["u"], out["qp"], out["kd"], out["aqk"], out["gl"], out["gc"], out["rq"], out["rk"],
            out["flag"], out.get("xinv", dummy), out.get("akk", dummy),
            scale, H,
            K=K, V=V, BT=BT, SUB=SUB, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V),
            GATE=gate, LOWER_BOUND=lower_bound, HAS_DT_BIAS=dt_bias is not None, L2NORM=l2norm, L2_EPS=l2_eps,
            BETA_SIGMOID=beta_sigmoid, SPAN_MAX=SPAN_MAX, LOWP=sel != 2 and lowp, STORE_X=store_x, SEL=sel,
            **K1_CONFIG,
        )
    return out


def kda_fwd_recurrence(intra: dict, h0, chunk_offsets, cu_seqlens, *, n_seqs: int, V: int, out_dtype,
                       store_o: bool, store_ht: bool, store_states: bool):
    """Run the recurrence kernel over the intra outputs. Returns (o [T, H, V] or None, ht [N, H, K, V] fp32 or
    None, h [NC, H, K, V] or None (state entering each chunk), d [T, H, V] or None (the chunks' U - W S))."""
    w = intra["w"]
    T, H, K = w.shape
    NC = intra["gl"].shape[0]
    o = w.new_empty(T, H, V, dtype=out_dtype) if store_o else None
    ht = w.new_empty(n_seqs, H, K, V, dtype=torch.float32) if store_ht else None
    h = w.new_empty(NC, H, K, V) if store_states else None
    d = w.new_empty(T, H, V) if store_states else None
    dummy = w.new_empty(1)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), n_seqs, H)

    kda_fwd_kernel_recurrence[grid](
        w, intra["u"], intra["qp"], intra["kd"], intra["aqk"], intra["gl"],
        dummy if h0 is None else h0, chunk_offsets, cu_seqlens,
        dummy if o is None else o, dummy if ht is None else ht, dummy if h is None else h, dummy if d is None else d,
        H,
        K=K, V=V, BT=BT, BK=triton.next_power_of_2(K),
        HAS_H0=h0 is not None, STORE_HT=store_ht, STORE_H=store_states, STORE_D=store_states, STORE_O=store_o,
    )
    return o, ht, h, d
