"""FP8 (e4m3) expert GEMMs with fine-grained scales, forward and backward: the "fp8" grouped GEMM backend.

Recipe (DeepSeek-V3's, fp32 accumulation promoted every 128 of the reduction):
    forward  y  = x w         x: 1x128 tiles along D            w[e]: 128x128 blocks
    dgrad    dx = dy w^T      dy: 1x128 tiles along F           w[e]^T: the same 128x128 blocks, transposed
    wgrad    dw = x^T dy      x and dy: 128x1 tiles along each expert's tokens (the reduction of this GEMM)
Each MMA covers exactly one 128-wide slice of the reduction, whose two scales are constant over it, so
acc += dot(q_a, q_b) * s_a * s_b in fp32 is exact up to the MMA's own rounding. For the weight gradient the scales
must be constant along tokens, hence 128x1 (per column, 128 tokens of one expert) for both operands: DeepSeek-V3
used 1x128 for dY only where dY's reduction is its feature dim (dgrad); in wgrad a 1x128 tiling of dY would vary
along the reduction. The token tiles are aligned to expert starts (fp8_quant.quantize_token_tiles).

What backward saves: x quantised as the wgrad operand (qT [D, P] fp8 + fp32 scales: about half the bytes of bf16
x, and exactly what wgrad reads, so no dequantise / requantise), w (the parameter itself, no copy: backward
requantises w^T, whose blocks and scales equal the forward's), offs. This replaces memory/precision.py's per-row
FP8 storage for this backend (it also composes with it: ExpertSeam then saves its own copy).

Versions: v3 is the default (session 13; the older ones stay selectable for comparison and tests).
v1 (`MOESTACK_FP8_V2=0`, or v2=False) requantises the weights on every call (one bf16 read of w and one fp8 write,
three times the bytes the GEMM itself then reads: at few rows per expert the GEMM streams weights, so this alone
made fp8 ~0.4x of bf16).
v2 (`MOESTACK_FP8_V3=0`, or v2=True, v3=False): fp8_weight_cache.py keeps each weight's fp8 blocks and scales
(forward and dX layouts) until the next optimizer step (a global step hook: fused AdamW does not bump version
counters) or until the parameter's version counter moves (other in-place updates), so all micro-batches of one
step quantise once; and the forward kernel applies the weight scale as one scalar per tile when BN divides 128 (one
128x128 block column) instead of a [BN] vector per 128-slice; and at few rows per expert (mean <=
MOESTACK_FP8_SWAP_MAX_ROWS, default 64) forward and dX run swap-AB (y^T = w^T x^T: the weight's 128 output columns
are the MMA's M side, BT = 16..64 token rows its N side; both operands stay K-major, as fp8 wgmma needs), so no MMA
work goes to padding rows.

v3 (default; implies v2's weight cache and kernels): activations quantised by one fused
pass per operand (fp8_quant.quantize_dual: x read once for both its 1x128 row tiles and its saved 128x1 token
tiles; dy likewise for dX and dW), both weight layouts from one read of the weight (fp8_weight_cache.pair), and
at mean rows per expert >= MOESTACK_FP8_CUBLAS_MIN_ROWS (512) with K, F multiples of 512 on sm90 the three GEMMs
run one cuBLAS blockwise call per expert (fp8_scaled_mm.py; one host read of the offsets, cached per offsets
tensor), else the Triton kernels above, or with MOESTACK_FP8_TMA=1 the TMA-descriptor forward / dX kernel of
fp8_tma.py (opt-in, unmeasured). The weight gradient alone can take the cuBLAS path from its own threshold,
MOESTACK_FP8_CUBLAS_WGRAD_MIN_ROWS (default: the same as the forward's): its per-expert GEMMs are D x F, large
even at few rows per expert.

Legend: N rows, E experts, K reduction width, F output width, D / F width of x / dy in wgrad, P padded tokens.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moestack.ops.moe import fp8_quant as fq
from moestack.ops.moe import fp8_scaled_mm as fsm
from moestack.ops.moe import fp8_weight_cache
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

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
V2_ENV = "MOESTACK_FP8_V2"  # "0" (with V3 "0"): v1, weights requantised every call; default "1"
V3_ENV = "MOESTACK_FP8_V3"  # "0": v2 only (no fused quantisers, no per-expert cuBLAS); default "1" (v3)
TMA_ENV = "MOESTACK_FP8_TMA"  # "1": v3's Triton forward / dX through fp8_tma.py (TMA descriptors); default "0"
TMA_WGRAD_ENV = "MOESTACK_FP8_TMA_WGRAD"  # "1": v3's Triton weight gradient through fp8_tma.py; default "0"
# v3's GEMMs at many rows per expert: "cublas" (default: fp8_scaled_mm, one torch._scaled_mm per expert, after a
# host read of the offsets) or "gluon" (sm_90: gluon_fp8_gemm.py forward / dX, one persistent launch, no host sync
# in the forward; the weight gradient stays per-expert cuBLAS from a pinned copy of the offsets, or with
# MOESTACK_FP8_TMA_WGRAD=1 fp8_tma's Triton kernel: no host read at all). Speed: benchmarks/RESULTS.md session 10
ROWS_GEMM_ENV = "MOESTACK_FP8_ROWS_GEMM"


SWAP_MAX_ROWS = int(os.environ.get("MOESTACK_FP8_SWAP_MAX_ROWS", "64"))  # v2: swap-AB at or below this mean
SWAP_BT_MAX = 64  # token tile cap: [128, BT] accumulator + the slice product fit 4 warps' registers up to 64


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: use 1 (default) or 0 (the older fp8 recipe versions, module doc)")
    return value == "1"


def use_v2(v2: bool | None) -> bool:
    return _env_flag(V2_ENV) if v2 is None else bool(v2)


def use_v3(v3: bool | None) -> bool:
    return _env_flag(V3_ENV) if v3 is None else bool(v3)


def _gluon_rows_gemm(x: torch.Tensor):
    """gluon_fp8_gemm where $MOESTACK_FP8_ROWS_GEMM=gluon and it runs; else None (per-expert cuBLAS)."""
    choice = os.environ.get(ROWS_GEMM_ENV, "cublas")
    if choice not in ("gluon", "cublas"):
        raise ValueError(f"{ROWS_GEMM_ENV}={choice!r}: use 'cublas' (default) or 'gluon' (sm_90, no host sync)")
    return fq.gluon_module("gluon_fp8_gemm", x.device) if choice == "gluon" and x.is_cuda else None


def _triton_rows_mm(qx, sx, qw, sw, offs_E, out_dtype, swap: int) -> torch.Tensor:
    """v3's Triton forward / dX: the TMA kernel (fp8_tma.py) with MOESTACK_FP8_TMA=1 where it applies, else v2's."""
    if os.environ.get(TMA_ENV, "0") == "1":
        from moestack.ops.moe import fp8_tma

        if fp8_tma.supported(qx, qw):
            return fp8_tma.grouped_mm(qx, sx, qw, sw, offs_E, out_dtype)
    return fp8_grouped_mm_quantized(qx, sx, qw, sw, offs_E, out_dtype, tile_sw=True, swap_max_rows=swap)


def _swap_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BF": 32}, num_warps=4, num_stages=1)]
    # 72..96 KB shared (BT 16..64); one config per BT (_prune_swap): 4 warps spill at BT = 64, so 8 there
    return [triton.Config({"BF": 128}, num_warps=w, num_stages=4) for w in (4, 8)]


def _prune_swap(configs, named_args, **kwargs):
    want = 8 if kwargs.get("BT", 0) >= 64 else 4
    return [c for c in configs if c.num_warps == want] or configs


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


@triton.autotune(configs=_mm_configs(), key=["ROWS_BUCKET", "K", "F", "E"], do_bench=quick_bench)
@triton.jit(do_not_specialize=["N", "E", "ROWS_BUCKET"])
def fp8_grouped_mm_fwd_kernel(
    qx, sx, qw, sw, y, offs, N, K, F, E,
    stride_xn, stride_sxn, stride_we, stride_wk, stride_wf, stride_swe, stride_swk, stride_yn,
    ROWS_BUCKET, BE: tl.constexpr, PRECISION: tl.constexpr, BK: tl.constexpr, TILE_SW: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):
    """y[rows of e] = sum over k-blocks of (qx @ qw[e]) * sx[row, kb] * sw[e, kb, col // 128]. Same persistent
    schedule as triton_grouped_gemm.grouped_mm_fwd_kernel; BK = 128 = the quantisation group. TILE_SW (v2): when
    BN divides BK the tile's columns lie in one weight block, so its scale is one scalar per 128-slice."""
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
            if TILE_SW and BK % BN == 0:
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


@triton.autotune(configs=_wgrad_configs(), key=["ROWS_BUCKET", "D", "F", "E"], do_bench=quick_bench)
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


def fp8_grouped_mm_quantized(qx, sx, qw, sw, offs_E, out_dtype: torch.dtype, tile_sw: bool = False,
                             swap_max_rows: int = 0) -> torch.Tensor:
    """y [N, F] from 1x128-quantised x (qx [N, K], sx [N, K/128]) and 128x128-quantised w (qw [E, K, F] with K
    contiguous, sw [E, K/128, F/128]). Rows >= offs[-1] are zero. tile_sw: v2's scalar weight scale per tile;
    swap_max_rows: swap-AB kernel when mean rows per expert <= this (v2)."""
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
            _rows_bucket(N, E), BE=triton.next_power_of_2(E), PRECISION=_precision(qx), BK=fq.GROUP, BT=BT,
        )
        return y

    def grid(meta):
        return (max(1, min(max_programs, (triton.cdiv(N, meta["BM"]) + E) * triton.cdiv(F, meta["BN"]))),)

    fp8_grouped_mm_fwd_kernel[grid](
        qx, sx, qw, sw, y, offs_E, N, K, F, E,
        qx.stride(0), sx.stride(0), qw.stride(0), qw.stride(1), qw.stride(2), sw.stride(0), sw.stride(1), y.stride(0),
        _rows_bucket(N, E), BE=triton.next_power_of_2(E), PRECISION=_precision(qx), BK=fq.GROUP, TILE_SW=tile_sw,
    )
    return y


def fp8_grouped_wgrad_quantized(qxT, sx, qdyT, sdy, offs_E, like: torch.Tensor) -> torch.Tensor:
    """dw [E, D, F] from token-tile-quantised x and dy (fp8_quant.quantize_token_tiles); zero for empty experts;
    in like's dtype, laid out as like when like is the transposed view of a contiguous [E, F, D] parameter."""
    D, P = qxT.shape
    F = qdyT.shape[0]
    E = like.shape[0]
    dw = empty_grad_like(like, D, F)

    def grid(meta):
        return (triton.cdiv(D, meta["BD"]) * triton.cdiv(F, meta["BF"]), E)

    fp8_grouped_mm_wgrad_kernel[grid](
        qxT, sx, qdyT, sdy, dw, offs_E, D, F, E, P, dw.stride(0), dw.stride(1), dw.stride(2),
        _rows_bucket(P, E), BE=triton.next_power_of_2(E), PRECISION=_precision(qxT), G=fq.GROUP,
    )
    return dw


class Fp8GroupedMM(torch.autograd.Function):
    """y = grouped x @ w in FP8 (module docstring has the recipe and what is saved). `q_dtype` float32 runs the
    same kernels on unrounded scaled values (interpreter tests of the scale logic)."""

    @staticmethod
    def forward(ctx, x_ND, w_EDF, offs_E, q_dtype=fq.FP8, v2=False, swap_max_rows=None):
        swap = (SWAP_MAX_ROWS if swap_max_rows is None else swap_max_rows) if v2 else 0
        qx, sx = fq.quantize_rows(x_ND, q_dtype)
        qw, sw = _weight_blocks(w_EDF, q_dtype, v2)
        y = fp8_grouped_mm_quantized(qx, sx, qw, sw, offs_E, x_ND.dtype, tile_sw=v2, swap_max_rows=swap)
        saved_x = fq.quantize_token_tiles(x_ND, offs_E, q_dtype) if ctx.needs_input_grad[1] else (None, None)
        ctx.save_for_backward(*saved_x, w_EDF, offs_E)
        ctx.q_dtype, ctx.x_dtype, ctx.v2, ctx.swap = q_dtype, x_ND.dtype, v2, swap
        return y

    @staticmethod
    def backward(ctx, dy_NF):
        qxT, sxT, w_EDF, offs_E = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qdy, sdy = fq.quantize_rows(dy_NF, ctx.q_dtype)
            qwT, swT = _weight_blocks(w_EDF.transpose(1, 2), ctx.q_dtype, ctx.v2)
            dx = fp8_grouped_mm_quantized(qdy, sdy, qwT, swT, offs_E, ctx.x_dtype, tile_sw=ctx.v2,
                                          swap_max_rows=ctx.swap)
        if ctx.needs_input_grad[1]:
            qdyT, sdyT = fq.quantize_token_tiles(dy_NF, offs_E, ctx.q_dtype)
            dw = fp8_grouped_wgrad_quantized(qxT, sxT, qdyT, sdyT, offs_E, like=w_EDF)
        return dx, dw, None, None, None, None


def _triton_wgrad(qxT, sxT, qdyT, sdyT, offs_E, like) -> torch.Tensor:
    """v3's Triton weight gradient: fp8_tma.wgrad with MOESTACK_FP8_TMA_WGRAD=1 where it applies, else v2's."""
    if os.environ.get(TMA_WGRAD_ENV, "0") == "1":
        from moestack.ops.moe import fp8_tma

        if fp8_tma.wgrad_supported(qxT, qdyT):
            return fp8_tma.wgrad(qxT, sxT, qdyT, sdyT, offs_E, like)
    return fp8_grouped_wgrad_quantized(qxT, sxT, qdyT, sdyT, offs_E, like=like)


class Fp8GroupedMMv3(torch.autograd.Function):
    """v3 (module docstring): fused quantisers, both weight layouts cached from one pass, per-expert cuBLAS
    blockwise GEMMs at many rows per expert (fp8_scaled_mm; or the Gluon kernel with $MOESTACK_FP8_ROWS_GEMM=gluon),
    else v2's Triton kernels. Saves for backward: x's fp8 token tiles (as v1 / v2), w (the parameter, no copy),
    offs, and the host offsets on the cuBLAS path.
    host_ends: offs_E's values when the caller knows them on the host (fp8_linear: [N]); None = read them once
    through fsm.host_offsets (a device-to-host sync, cached for one offsets tensor only)."""

    @staticmethod
    def forward(ctx, x_ND, w_EDF, offs_E, q_dtype=fq.FP8, swap_max_rows=None, cublas_min_rows=None,
                host_ends: list[int] | None = None):
        N, D = x_ND.shape
        E, _, F = w_EDF.shape
        min_rows = fsm.cublas_min_rows() if cublas_min_rows is None else cublas_min_rows
        cublas = N > 0 and N >= min_rows * E and fsm.shapes_ok(D, F) and fsm.available(x_ND.device)
        # the weight gradient alone may take cuBLAS from its own threshold (its GEMMs are D x F per expert, so
        # they stay large at few rows); it needs no 128x128 scales, only D, F multiples of 16
        wg_rows = fsm.cublas_wgrad_min_rows(min_rows)
        cublas_wg = cublas or (ctx.needs_input_grad[1] and N > 0 and N >= wg_rows * E and D % 16 == 0
                               and F % 16 == 0 and fsm.available(x_ND.device))
        swap = SWAP_MAX_ROWS if swap_max_rows is None else swap_max_rows
        (qw, sw), (_, swT) = fp8_weight_cache.pair(w_EDF, q_dtype)
        save = ctx.needs_input_grad[1]
        qx, sx, qxT, sxT = fq.quantize_dual(x_ND, offs_E, q_dtype, expert_major=cublas, tiles=save)
        # the rows GEMMs without the per-expert host loop; same operands as cuBLAS's (expert-major row scales), so
        # where the kernel does not take them the per-expert path below still does
        gluon = _gluon_rows_gemm(x_ND) if cublas else None
        if gluon is not None and not gluon.supported(qx, qw):
            gluon = None
        ends = None
        if gluon is not None:
            y = gluon.grouped_mm(qx, sx, qw, sw, offs_E, x_ND.dtype)
        elif cublas:
            ends = _host_ends(offs_E, host_ends)
            y = fsm.rows_mm(qx, sx, qw, sw, swT, ends, x_ND.dtype)
        else:
            y = _triton_rows_mm(qx, sx, qw, sw, offs_E, x_ND.dtype, swap)
        ctx.save_for_backward(qxT, sxT, w_EDF, offs_E)
        ctx.q_dtype, ctx.x_dtype, ctx.swap, ctx.ends, ctx.gluon = q_dtype, x_ND.dtype, swap, ends, gluon
        # The Gluon path with MOESTACK_FP8_TMA_WGRAD=1 takes fp8_tma's Triton weight gradient: no host read of the
        # offsets at all (slower than per-expert cuBLAS: benchmarks/RESULTS.md session 10). The per-expert cuBLAS
        # weight gradient needs the offsets on the host: where the forward did not read them (the Gluon path) they
        # are copied to pinned memory now, without waiting, and read in backward, long after the copy finished.
        ctx.gluon_wg = gluon is not None and os.environ.get(TMA_WGRAD_ENV, "0") == "1"
        ctx.wg_ends = (ends if ends is not None else host_ends) if cublas_wg else None
        ctx.offs_host = (_offsets_to_host_async(offs_E) if cublas_wg and ctx.wg_ends is None and not ctx.gluon_wg
                         else None)
        ctx.cublas_wg = cublas_wg
        return y

    @staticmethod
    def backward(ctx, dy_NF):
        qxT, sxT, w_EDF, offs_E = ctx.saved_tensors
        ends, gluon = ctx.ends, ctx.gluon
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        qdy, sdy, qdyT, sdyT = fq.quantize_dual(dy_NF, offs_E, ctx.q_dtype,
                                                expert_major=ends is not None or gluon is not None, tiles=need_dw)
        dx = dw = None
        if need_dx:
            (_, sw), (qwT, swT) = fp8_weight_cache.pair(w_EDF, ctx.q_dtype)
            if gluon is not None:  # qdy and w^T: quantize_dual's and the weight cache's layouts, as in the forward
                dx = gluon.grouped_mm(qdy, sdy, qwT, swT, offs_E, ctx.x_dtype)
            elif ends is not None:  # w^T's block scales are swT [E, F/128, D/128], transposed: the forward's sw
                dx = fsm.rows_mm(qdy, sdy, qwT, swT, sw, ends, ctx.x_dtype)
            else:
                dx = _triton_rows_mm(qdy, sdy, qwT, swT, offs_E, ctx.x_dtype, ctx.swap)
        if need_dw:
            from moestack.ops.moe import fp8_tma

            if ctx.gluon_wg and fp8_tma.wgrad_supported(qxT, qdyT):
                dw = fp8_tma.wgrad(qxT, sxT, qdyT, sdyT, offs_E, w_EDF)
            elif ctx.cublas_wg:
                wg_ends = ctx.wg_ends if ctx.wg_ends is not None else _offsets_from_host(ctx.offs_host, offs_E)
                dw = fsm.wgrad(qxT, sxT, qdyT, sdyT, wg_ends, like=w_EDF)
            else:
                dw = _triton_wgrad(qxT, sxT, qdyT, sdyT, offs_E, w_EDF)
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


def _weight_blocks(w_EKF: torch.Tensor, q_dtype: torch.dtype, v2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks of w (reduction dim contiguous): from the per-version cache in v2, else quantised now."""
    if v2:
        return fp8_weight_cache.blocks(w_EKF, q_dtype)
    return fq.quantize_blocks(w_EKF, q_dtype)


def grouped_mm(
    x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, v2: bool | None = None,
    swap_max_rows: int | None = None, v3: bool | None = None, cublas_min_rows: int | None = None,
) -> torch.Tensor:
    """The "fp8" backend: same contract as reference.grouped_mm; output in the autocast dtype inside autocast,
    else x's dtype (bf16 in practice). Differentiable in x and w (gradients from the FP8 recipe).
    v2: cached weights + per-tile weight scale + swap-AB at few rows (module doc); None = $MOESTACK_FP8_V2 (default
    on; 0 = v1). swap_max_rows (v2 only): None = $MOESTACK_FP8_SWAP_MAX_ROWS (64); 0 = never swap.
    v3 (None = $MOESTACK_FP8_V3, default on; includes v2, not taken when v2 is off): fused quantisers, per-expert
    cuBLAS at mean rows >= cublas_min_rows (None = $MOESTACK_FP8_CUBLAS_MIN_ROWS, 512)."""
    from moestack.ops.moe.reference import _compute_dtype

    _check(x_ND, w_EDF, offs_E)
    dtype = _compute_dtype(x_ND, w_EDF)
    if use_v3(v3) and use_v2(v2):  # v3 includes v2; v2 off (argument or environment) keeps v1
        return Fp8GroupedMMv3.apply(x_ND.to(dtype), w_EDF, offs_E.contiguous(), fq.FP8, swap_max_rows,
                                    cublas_min_rows)
    if use_v2(v2):
        # w in its own dtype: quantised (and cached) from the parameter itself. An autocast copy w.to(bf16) would
        # be a new tensor on every call (no cache hit); dw comes back in w's dtype from the fp32 accumulators.
        return Fp8GroupedMM.apply(x_ND.to(dtype), w_EDF, offs_E.contiguous(), fq.FP8, True, swap_max_rows)
    return Fp8GroupedMM.apply(x_ND.to(dtype), w_EDF.to(dtype), offs_E.contiguous(), fq.FP8, False)


def grouped_mm_fp8_reference(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """The forward spec in torch: dequantise(quantise(x)) @ dequantise(quantise(w)) per expert, fp32."""
    from moestack.ops.moe.reference import grouped_mm_loop

    qx, sx = fq.quantize_rows_ref(x_ND)
    qw, sw = fq.quantize_blocks_ref(w_EDF)
    return grouped_mm_loop(fq.dequantize_rows(qx, sx), fq.dequantize_blocks(qw, sw), offs_E)
