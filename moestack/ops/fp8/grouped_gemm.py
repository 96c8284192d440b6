"""FP8 (e4m3) expert GEMMs with fine-grained scales, forward and backward: the experts' GEMM under `precision: fp8`.

Recipe (DeepSeek-V3's, fp32 accumulation promoted every 128 of the reduction):
    forward  y  = x w         x: 1x128 tiles along D            w[e]: 128x128 blocks
    dgrad    dx = dy w^T      dy: 1x128 tiles along F           w[e]^T: the same 128x128 blocks, transposed
    wgrad    dw = x^T dy      x and dy: 128x1 tiles along each expert's tokens (the reduction of this GEMM)
Each MMA covers exactly one 128-wide slice of the reduction, whose two scales are constant over it, so
acc += dot(q_a, q_b) * s_a * s_b in fp32 is exact up to the MMA's own rounding. For the weight gradient the scales
must be constant along tokens, hence 128x1 (per column, 128 tokens of one expert) for both operands: DeepSeek-V3
used 1x128 for dY only where dY's reduction is its feature dim (dgrad); in wgrad a 1x128 tiling of dY would vary
along the reduction. The token tiles are aligned to expert starts (reference.quantize_token_tiles_ref).

How: activations quantised by one fused pass per operand (quant.quantize_dual: x read once for both its 1x128 row
tiles and its saved 128x1 token tiles; dy likewise for dX and dW); both weight layouts from one read of the weight,
cached per parameter version until the optimizer step (weight_cache.pair); at mean rows per expert >=
cublas_min_rows (KernelSpec.fp8.cublas_min_rows, 512) with K, F multiples of 512 on sm90 the three GEMMs run one
cuBLAS blockwise call per expert (scaled_mm.py; one host read of the offsets, cached per offsets tensor), else the
Triton kernels below: the weight scale as one scalar per tile where BN divides 128, and at few rows per expert
(mean <= SWAP_MAX_ROWS) forward and dX swap-AB (y^T = w^T x^T: the weight's 128 output columns are the MMA's M side,
BT = 16..64 token rows its N side; both operands stay K-major, as fp8 wgmma needs). The weight gradient alone takes
the cuBLAS path from the same threshold with D, F multiples of 16 (its per-expert GEMMs are D x F: large at any row
count).

What backward saves: x quantised as the wgrad operand (qT [D, P] fp8 + fp32 scales: about half the bytes of bf16
x, and exactly what wgrad reads), w (the parameter itself, no copy: backward reads w^T's blocks from the cache),
offs. So the experts' FP8 activation storage (moestack/memory/precision.py) is not added on top.
(Versions without the fused quantisers and the cache, and a Gluon / TMA-descriptor forward and weight gradient,
were measured and removed: README.md, benchmarks/RESULTS.md.)

Legend: N rows, E experts, K reduction width, F output width, D / F width of x / dy in wgrad, P padded tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moestack.ops.fp8 import quant as fq
from moestack.ops.fp8 import scaled_mm as fsm
from moestack.ops.fp8 import weight_cache
from moestack.ops.fp8.reference import FP8, GROUP
from moestack.ops.moe.triton_grouped_gemm import (
    _check,
    _expert_tiles,
    _num_programs,
    _pick,
    _rows_bucket,
    empty_grad_like,
    quick_bench,
    swap_token_tile,
)
from moestack.ops.opaque import opaque

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SWAP_MAX_ROWS = 64  # swap-AB at or below this mean rows per expert
SWAP_BT_MAX = 64  # token tile cap: [128, BT] accumulator + the slice product fit 4 warps' registers up to 64
CUBLAS_MIN_ROWS = 512  # KernelSpec.fp8.cublas_min_rows' default


def _swap_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BF": 32}, num_warps=4, num_stages=1)]
    # 72..96 KB shared (BT 16..64); one config per BT (_prune_swap): 4 warps spill at BT = 64, so 8 there
    return [triton.Config({"BF": 128}, num_warps=w, num_stages=4) for w in (4, 8)]


def _prune_swap(configs, named_args, **kwargs):
    """One config per BT (4 warps spill at BT = 64, so 8 there), if it fits the device."""
    from moestack.ops.launch import fit_configs

    args = {**named_args, **kwargs}
    want = 8 if args.get("BT", 0) >= 64 else 4
    return fit_configs([c for c in configs if c.num_warps == want] or configs, args, "fp8_swap")


def _prune_mm(configs, named_args, **kwargs):
    from moestack.ops.launch import fit_configs

    return fit_configs(configs, {**named_args, **kwargs}, "fp8_mm")


def _prune_wgrad(configs, named_args, **kwargs):
    from moestack.ops.launch import fit_configs

    return fit_configs(configs, {**named_args, **kwargs}, "fp8_wgrad")


def _mm_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BM": 16, "BN": 32}, num_warps=4, num_stages=1)]
    # two fp32 [BM, BN] tiles live per thread (the accumulator and the scaled 128-slice product): 128x256 spills
    shapes = [(64, 128, 4, 4), (128, 128, 8, 3), (64, 256, 8, 3)]
    return [triton.Config({"BM": m, "BN": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


def _wgrad_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BD": 16, "BF": 32}, num_warps=4, num_stages=1)]
    shapes = [(128, 128, 8, 3), (64, 128, 4, 4)]
    return [triton.Config({"BD": d, "BF": f}, num_warps=w, num_stages=s) for d, f, w, s in shapes]


@triton.autotune(configs=_mm_configs(), key=["ROWS_BUCKET", "K", "F", "E"], do_bench=quick_bench,
                 prune_configs_by={"early_config_prune": _prune_mm})
@triton.jit(do_not_specialize=["N", "E", "ROWS_BUCKET"])
def fp8_grouped_mm_fwd_kernel(
    qx, sx, qw, sw, y, offs, N, K, F, E,
    stride_xn, stride_sxn, stride_we, stride_wk, stride_wf, stride_swe, stride_swk, stride_yn,
    ROWS_BUCKET, BE: tl.constexpr, PRECISION: tl.constexpr, BK: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):
    """y[rows of e] = sum over k-blocks of (qx @ qw[e]) * sx[row, kb] * sw[e, kb, col // 128]. The persistent
    schedule of triton_grouped_gemm (module doc there) with (BT, BF) -> (BM, BN); BK = 128 = the quantisation
    group. When BN divides BK the tile's columns lie in one weight block: its scale is one scalar per 128-slice."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    o_e = tl.arange(0, BE)
    b_start, b_end, b_tiles, b_tile_end = _expert_tiles(offs, E, o_e, BM)
    n_ntiles = tl.cdiv(F, BN)
    b_work_end = b_tile_end * n_ntiles
    total = tl.sum(b_tiles, 0) * n_ntiles
    o_m, o_n, o_k = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    for t in range(pid, total, nprog):
        e = tl.sum((b_work_end <= t).to(tl.int32), 0)
        sel = o_e == e
        tiles_e = _pick(b_tiles, sel)
        local = t - (_pick(b_work_end, sel) - tiles_e * n_ntiles)
        i_n, i_m = local // tiles_e, local % tiles_e
        rows = _pick(b_start, sel) + i_m * BM + o_m  # [BM]
        m_rows = rows < _pick(b_end, sel)
        rows64 = rows.to(tl.int64)
        cols = i_n * BN + o_n  # [BN]
        m_cols = cols < F
        e64 = e.to(tl.int64)
        p_x = qx + rows64[:, None] * stride_xn
        p_w = qw + e64 * stride_we + cols.to(tl.int64)[None, :] * stride_wf
        p_sx = sx + rows64 * stride_sxn  # [BM]
        p_sw = sw + e64 * stride_swe + cols // BK  # [BN]
        b_acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(tl.cdiv(K, BK)):
            ks = kb * BK + o_k
            m_k = ks < K
            b_x = tl.load(p_x + ks[None, :], mask=m_rows[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
            b_w = tl.load(p_w + ks[:, None] * stride_wk, mask=m_k[:, None] & m_cols[None, :], other=0.0)  # [BK, BN]
            b_sx = tl.load(p_sx + kb, mask=m_rows, other=0.0)  # [BM]
            if BK % BN == 0:
                b_s = b_sx * tl.load(sw + e64 * stride_swe + kb * stride_swk + (i_n * BN) // BK)  # [BM]
                b_acc += tl.dot(b_x, b_w, input_precision=PRECISION) * b_s[:, None]
            else:
                b_sw = tl.load(p_sw + kb * stride_swk, mask=m_cols, other=0.0)  # [BN]
                b_acc += tl.dot(b_x, b_w, input_precision=PRECISION) * b_sx[:, None] * b_sw[None, :]
        p_y = y + rows64[:, None] * stride_yn + cols[None, :]
        tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_rows[:, None] & m_cols[None, :])
    used = tl.load(offs + E - 1)
    for t in range(pid, tl.cdiv(N - used, BM) * n_ntiles, nprog):
        rows = used + (t // n_ntiles) * BM + o_m
        cols = (t % n_ntiles) * BN + o_n
        p_y = y + rows.to(tl.int64)[:, None] * stride_yn + cols[None, :]
        tl.store(p_y, tl.zeros((BM, BN), dtype=y.dtype.element_ty), mask=(rows < N)[:, None] & (cols < F)[None, :])


@triton.autotune(configs=_swap_configs(), key=["ROWS_BUCKET", "K", "F", "E", "BT"], do_bench=quick_bench,
                 prune_configs_by={"early_config_prune": _prune_swap})
@triton.jit(do_not_specialize=["N", "E", "ROWS_BUCKET"])
def fp8_grouped_mm_fwd_swap_kernel(
    qx, sx, qw, sw, y, offs, N, K, F, E,
    stride_xn, stride_sxn, stride_we, stride_wf, stride_swe, stride_swk, stride_yn,
    ROWS_BUCKET, BE: tl.constexpr, PRECISION: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr,
):
    """Swap-AB: acc [BF, BT] = sum over k-blocks of (qw[e][:, f-tile]^T @ qx[token-tile]^T) * sw * sx, stored
    transposed into y. BF divides BK = 128, so the weight scale is one scalar per tile and 128-slice."""
    tl.static_assert(BK % BF == 0)
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    o_e = tl.arange(0, BE)
    b_start, b_end, b_tiles, b_tile_end = _expert_tiles(offs, E, o_e, BT)
    n_ftiles = tl.cdiv(F, BF)
    b_work_end = b_tile_end * n_ftiles
    total = tl.sum(b_tiles, 0) * n_ftiles
    o_t, o_f, o_k = tl.arange(0, BT), tl.arange(0, BF), tl.arange(0, BK)
    for t in range(pid, total, nprog):
        e = tl.sum((b_work_end <= t).to(tl.int32), 0)
        sel = o_e == e
        tiles_e = _pick(b_tiles, sel)
        local = t - (_pick(b_work_end, sel) - tiles_e * n_ftiles)
        i_f, i_t = local // tiles_e, local % tiles_e
        rows = _pick(b_start, sel) + i_t * BT + o_t  # [BT]
        m_rows = rows < _pick(b_end, sel)
        rows64 = rows.to(tl.int64)
        cols = i_f * BF + o_f  # [BF]
        m_cols = cols < F
        e64 = e.to(tl.int64)
        p_w = qw + e64 * stride_we + cols.to(tl.int64)[:, None] * stride_wf  # [BF, 1], K contiguous
        p_x = qx + rows64[None, :] * stride_xn  # [1, BT], K contiguous
        p_sx = sx + rows64 * stride_sxn  # [BT]
        p_sw = sw + e64 * stride_swe + (i_f * BF) // BK  # scalar per 128-slice
        b_acc = tl.zeros((BF, BT), dtype=tl.float32)
        for kb in range(tl.cdiv(K, BK)):
            ks = kb * BK + o_k
            m_k = ks < K
            b_w = tl.load(p_w + ks[None, :], mask=m_cols[:, None] & m_k[None, :], other=0.0)  # [BF, BK]
            b_x = tl.load(p_x + ks[:, None], mask=m_k[:, None] & m_rows[None, :], other=0.0)  # [BK, BT]
            b_s = tl.load(p_sx + kb, mask=m_rows, other=0.0) * tl.load(p_sw + kb * stride_swk)  # [BT]
            b_acc += tl.dot(b_w, b_x, input_precision=PRECISION) * b_s[None, :]
        p_y = y + rows64[None, :] * stride_yn + cols[:, None]
        tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_cols[:, None] & m_rows[None, :])
    used = tl.load(offs + E - 1)
    for t in range(pid, tl.cdiv(N - used, BT) * n_ftiles, nprog):
        rows = used + (t // n_ftiles) * BT + o_t
        cols = (t % n_ftiles) * BF + o_f
        p_y = y + rows.to(tl.int64)[None, :] * stride_yn + cols[:, None]
        tl.store(p_y, tl.zeros((BF, BT), dtype=y.dtype.element_ty), mask=(cols < F)[:, None] & (rows < N)[None, :])


@triton.autotune(configs=_wgrad_configs(), key=["ROWS_BUCKET", "D", "F", "E"], do_bench=quick_bench,
                 prune_configs_by={"early_config_prune": _prune_wgrad})
@triton.jit(do_not_specialize=["E", "ROWS_BUCKET"])
def fp8_grouped_mm_wgrad_kernel(
    qxT, sx, qdyT, sdy, dw, offs, D, F, E, P,
    stride_we, stride_wd, stride_wf,
    ROWS_BUCKET, BE: tl.constexpr, PRECISION: tl.constexpr, G: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
):
    """dw[e] = sum over e's token tiles g of (qxT[:, g] @ qdyT[:, g]^T) * sx[g, d] * sdy[g, f]."""
    i_t, e = tl.program_id(0), tl.program_id(1)
    n_ftiles = tl.cdiv(F, BF)
    i_d, i_f = i_t // n_ftiles, i_t % n_ftiles
    o_e = tl.arange(0, BE)
    _, _, b_tiles, b_tile_end = _expert_tiles(offs, E, o_e, G)
    sel = o_e == e
    g_end = _pick(b_tile_end, sel)
    g_start = g_end - _pick(b_tiles, sel)
    o_d = i_d * BD + tl.arange(0, BD)
    o_f = i_f * BF + tl.arange(0, BF)
    o_g = tl.arange(0, G)
    m_d, m_f = o_d < D, o_f < F
    p_x = qxT + o_d.to(tl.int64)[:, None] * P  # [BD, 1]
    p_dy = qdyT + o_f.to(tl.int64)[:, None] * P  # [BF, 1]
    b_acc = tl.zeros((BD, BF), dtype=tl.float32)
    for g in range(g_start, g_end):
        toks = (g * G + o_g).to(tl.int64)  # [G]; g * G < 2^31 (padded token count)
        b_x = tl.load(p_x + toks[None, :], mask=m_d[:, None], other=0.0)  # [BD, G]
        b_dy = tl.load(p_dy + toks[None, :], mask=m_f[:, None], other=0.0)  # [BF, G]
        b_sx = tl.load(sx + g * D + o_d, mask=m_d, other=0.0)  # [BD]
        b_sdy = tl.load(sdy + g * F + o_f, mask=m_f, other=0.0)  # [BF]
        b_acc += tl.dot(b_x, tl.trans(b_dy), input_precision=PRECISION) * b_sx[:, None] * b_sdy[None, :]
    p_dw = dw + e.to(tl.int64) * stride_we + o_d[:, None] * stride_wd + o_f[None, :] * stride_wf
    tl.store(p_dw, b_acc.to(dw.dtype.element_ty), mask=m_d[:, None] & m_f[None, :])


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 only in the interpreter tests


def fp8_grouped_mm_quantized(qx, sx, qw, sw, offs_E, out_dtype: torch.dtype,
                             swap_max_rows: int = SWAP_MAX_ROWS) -> torch.Tensor:
    """y [N, F] from 1x128-quantised x (qx [N, K], sx [N, K/128]) and 128x128-quantised w (qw [E, K, F] with K
    contiguous, sw [E, K/128, F/128]). Rows >= offs[-1] are zero. swap_max_rows: the swap-AB kernel when mean rows
    per expert <= this."""
    N, K = qx.shape
    E, _, F = qw.shape
    assert qx.stride(1) == 1 and qw.stride(1) == 1 and sw.is_contiguous()
    y = torch.empty((N, F), device=qx.device, dtype=out_dtype)
    if N == 0 or F == 0:
        return y
    max_programs = _num_programs(qx.device)
    if N <= swap_max_rows * E:
        BT = min(SWAP_BT_MAX, swap_token_tile(N, E))

        def grid_swap(meta):
            return (max(1, min(max_programs, (triton.cdiv(N, BT) + E) * triton.cdiv(F, meta["BF"]))),)

        fp8_grouped_mm_fwd_swap_kernel[grid_swap](
            qx, sx, qw, sw, y, offs_E, N, K, F, E,
            qx.stride(0), sx.stride(0), qw.stride(0), qw.stride(2), sw.stride(0), sw.stride(1), y.stride(0),
            _rows_bucket(N, E), BE=triton.next_power_of_2(E), PRECISION=_precision(qx), BK=GROUP, BT=BT,
        )
        return y

    def grid(meta):
        return (max(1, min(max_programs, (triton.cdiv(N, meta["BM"]) + E) * triton.cdiv(F, meta["BN"]))),)

    fp8_grouped_mm_fwd_kernel[grid](
        qx, sx, qw, sw, y, offs_E, N, K, F, E,
        qx.stride(0), sx.stride(0), qw.stride(0), qw.stride(1), qw.stride(2), sw.stride(0), sw.stride(1), y.stride(0),
        _rows_bucket(N, E), BE=triton.next_power_of_2(E), PRECISION=_precision(qx), BK=GROUP,
    )
    return y


def fp8_grouped_wgrad_quantized(qxT, sx, qdyT, sdy, offs_E, like: torch.Tensor) -> torch.Tensor:
    """dw [E, D, F] from token-tile-quantised x and dy (quant.quantize_dual's token tiles); zero for empty experts;
    in like's dtype, laid out as like when like is the transposed view of a contiguous [E, F, D] parameter."""
    D, P = qxT.shape
    F = qdyT.shape[0]
    E = like.shape[0]
    dw = empty_grad_like(like, D, F)

    def grid(meta):
        return (triton.cdiv(D, meta["BD"]) * triton.cdiv(F, meta["BF"]), E)

    fp8_grouped_mm_wgrad_kernel[grid](
        qxT, sx, qdyT, sdy, dw, offs_E, D, F, E, P, dw.stride(0), dw.stride(1), dw.stride(2),
        _rows_bucket(P, E), BE=triton.next_power_of_2(E), PRECISION=_precision(qxT), G=GROUP,
    )
    return dw


class Fp8GroupedMM(torch.autograd.Function):
    """The expert GEMM in FP8 (module docstring). Saves for backward: x's fp8 token tiles, w (the parameter, no
    copy), offs, and the host offsets on the cuBLAS path.
    host_ends: offs_E's values when the caller knows them on the host (linear.py: [N]); None = read them once
    through fsm.host_offsets (a device-to-host sync, cached for one offsets tensor only). cache_mode: the weight
    cache's (weight_cache.MODES)."""

    @staticmethod
    def forward(ctx, x_ND, w_EDF, offs_E, q_dtype=FP8, cublas_min_rows=CUBLAS_MIN_ROWS,
                host_ends: list[int] | None = None, cache_mode: str = "on"):
        N, D = x_ND.shape
        E, _, F = w_EDF.shape
        cublas = N > 0 and N >= cublas_min_rows * E and fsm.shapes_ok(D, F) and fsm.available(x_ND.device)
        # the weight gradient alone takes cuBLAS from the same threshold where only D, F are multiples of 16 (its
        # GEMMs are D x F per expert: no 128x128 scales)
        cublas_wg = cublas or (ctx.needs_input_grad[1] and N > 0 and N >= cublas_min_rows * E and D % 16 == 0
                               and F % 16 == 0 and fsm.available(x_ND.device))
        (qw, sw), (_, swT) = weight_cache.pair(w_EDF, q_dtype, cache_mode)
        save = ctx.needs_input_grad[1]
        qx, sx, qxT, sxT = fq.quantize_dual(x_ND, offs_E, q_dtype, expert_major=cublas, tiles=save)
        ends = None
        if cublas:
            ends = _host_ends(offs_E, host_ends)
            y = fsm.rows_mm(qx, sx, qw, sw, swT, ends, x_ND.dtype)
        else:
            y = fp8_grouped_mm_quantized(qx, sx, qw, sw, offs_E, x_ND.dtype)
        ctx.save_for_backward(qxT, sxT, w_EDF, offs_E)
        ctx.q_dtype, ctx.x_dtype, ctx.ends, ctx.cache_mode = q_dtype, x_ND.dtype, ends, cache_mode
        # The per-expert cuBLAS weight gradient needs the offsets on the host: where the forward did not read them
        # they are copied to pinned memory now, without waiting, and read in backward, long after the copy finished.
        ctx.wg_ends = (ends if ends is not None else host_ends) if cublas_wg else None
        ctx.offs_host = _offsets_to_host_async(offs_E) if cublas_wg and ctx.wg_ends is None else None
        ctx.cublas_wg = cublas_wg
        return y

    @staticmethod
    def backward(ctx, dy_NF):
        qxT, sxT, w_EDF, offs_E = ctx.saved_tensors
        ends = ctx.ends
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        qdy, sdy, qdyT, sdyT = fq.quantize_dual(dy_NF, offs_E, ctx.q_dtype, expert_major=ends is not None,
                                                tiles=need_dw)
        dx = dw = None
        if need_dx:
            (_, sw), (qwT, swT) = weight_cache.pair(w_EDF, ctx.q_dtype, ctx.cache_mode)
            if ends is not None:  # w^T's block scales are swT [E, F/128, D/128], transposed: the forward's sw
                dx = fsm.rows_mm(qdy, sdy, qwT, swT, sw, ends, ctx.x_dtype)
            else:
                dx = fp8_grouped_mm_quantized(qdy, sdy, qwT, swT, offs_E, ctx.x_dtype)
        if need_dw:
            if ctx.cublas_wg:
                wg_ends = ctx.wg_ends if ctx.wg_ends is not None else _offsets_from_host(ctx.offs_host, offs_E)
                dw = fsm.wgrad(qxT, sxT, qdyT, sdyT, wg_ends, like=w_EDF)
            else:
                dw = fp8_grouped_wgrad_quantized(qxT, sxT, qdyT, sdyT, offs_E, like=w_EDF)
        return dx, dw, None, None, None, None, None


def _offsets_to_host_async(offs_E: torch.Tensor):
    """(pinned copy of offs_E, event) queued now; None off CUDA (then the backward reads the offsets itself)."""
    if not offs_E.is_cuda:
        return None
    pinned = torch.empty(offs_E.shape, dtype=offs_E.dtype, pin_memory=True)
    pinned.copy_(offs_E, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return pinned, done


def _offsets_from_host(offs_host, offs_E: torch.Tensor) -> list[int]:
    if offs_host is None:
        return fsm.host_offsets(offs_E)
    pinned, done = offs_host
    done.synchronize()  # recorded in the forward: long complete by the backward
    return pinned.tolist()


def _host_ends(offs_E: torch.Tensor, host_ends: list[int] | None) -> list[int]:
    """The offsets on the host: the caller's when given (no sync, fsm's one-entry cache left alone), else read."""
    return fsm.host_offsets(offs_E) if host_ends is None else host_ends


@opaque
def grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, *, q_dtype: torch.dtype = FP8,
               cublas_min_rows: int = CUBLAS_MIN_ROWS, cache_mode: str = "on") -> torch.Tensor:
    """The FP8 expert GEMM: same contract as moestack.ops.moe.reference.grouped_mm; output in the autocast dtype
    inside autocast, else x's dtype (bf16 in practice). Differentiable in x and w (gradients from the FP8 recipe).
    w in its own dtype: quantised (and cached) from the parameter itself (an autocast copy w.to(bf16) would be a new
    tensor on every call, never a cache hit); dw comes back in w's dtype from the fp32 accumulators.
    q_dtype float32 runs the same kernels on unrounded scaled values (the interpreter tests)."""
    from moestack.ops.moe.reference import _compute_dtype

    _check(x_ND, w_EDF, offs_E)
    dtype = _compute_dtype(x_ND, w_EDF)
    return Fp8GroupedMM.apply(x_ND.to(dtype), w_EDF, offs_E.contiguous(), q_dtype, cublas_min_rows, None,
                              cache_mode)


@dataclass
class Fp8GroupedGemm:
    """The experts' GEMM strategy under `precision: fp8` (set on Experts.gemm by convert.py): grouped_mm with the
    KernelSpec's fp8 choices. It stores the inputs backward needs in FP8 itself (`saves_fp8_inputs`)."""

    cache_mode: str = "on"
    cublas_min_rows: int = CUBLAS_MIN_ROWS
    q_dtype: torch.dtype = FP8
    saves_fp8_inputs: bool = True

    def __call__(self, x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        return grouped_mm(x_ND, w_EDF, offs_E, q_dtype=self.q_dtype, cublas_min_rows=self.cublas_min_rows,
                          cache_mode=self.cache_mode)
