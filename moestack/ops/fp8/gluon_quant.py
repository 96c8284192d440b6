"""quant.quantize_dual's kernel in Gluon for sm_90: the same tiles and numbers, with layouts chosen for the stores.

quantize_dual reads x [N, K] (rows sorted by expert) once per [128 tokens of one expert, 128 columns] tile and
writes two fp8 copies: q [N, K] (1x128 row tiles, row-major) and qT [K, P] (128x1 token tiles, tokens contiguous).
The Triton kernel (quant.fp8_quant_dual_kernel) loads the tile in a row-major layout, so the transposed copy
goes through shared memory one byte per thread at a time (st.shared.b8, 33 CTA barriers per tile in its PTX) and
at 16 warps / 93 registers only one program fits per SM: it runs far below HBM bandwidth (benchmarks/RESULTS.md,
the FP8 layer profile).

The tile layout (tile_layout): each thread holds COLS consecutive columns x 128 * COLS / (32 * warps) consecutive
tokens; 128 / COLS lanes span the tile's columns, the other lanes and the warps stack along the tokens. So
- x loads are 2 * COLS-byte vectors (COLS = 8, the default: 16 bytes), a warp reads whole rows per instruction;
- row scales (max over a row's 128 columns) reduce inside each thread, then across the column lanes by shuffles;
- token-tile scales (max over 128 tokens) reduce inside each thread, then across lanes and warps;
- q stores COLS bytes per thread per row (whole 128-byte row segments per warp).
qT [K, P] (tokens contiguous) is stored through shared memory into lines_layout, 16 consecutive tokens of a column
per thread and 8 lanes along the tokens, so one warp store writes whole 128-byte lines of qT.

H200, K3 EP16 shapes (131040 rows, 56 experts), ms at K = 3584 / 3072 / 6144, TB/s counting the bf16 read and both
fp8 writes: the Triton kernel 1.16 / 0.99 / 1.97 (1.63 TB/s), this one (8 warps, 8 columns) 0.72 / 0.62 / 1.22
(2.62 TB/s; two programs per SM, 107-124 registers: the store pattern, not occupancy, was the limit). The other
launch configs and store patterns measured are in benchmarks/RESULTS.md (sessions 9-12).

Both kernels scale by one multiply, x * (448 / amax), and skip the clamp (|q| <= 448 up to one ulp, which the fp8
cast rounds back to 448): the divide and clamp per element had made the kernel instruction-bound (2032 SASS
instructions per thread and tile, then 1504; 1192 with 8 columns and qT lines). The bytes are the Triton kernel's
(same fp32 operations and casts; tests/ops/test_fp8_gluon_quant.py checks bitwise equality).
Requirements (`supported`): sm_90 (CUDA), Triton's Gluon, contiguous rows. Legend as quant.py.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

TILE = 128  # reference.GROUP: the scale groups' edge
CONFIG = (8, 8)  # (warps, columns per thread): the fastest measured (module doc)


@functools.cache
def supported(device_index: int) -> bool:
    """sm_90 (a Triton without Gluon fails the import above; quant.py then keeps the Triton kernel)."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.constexpr_function
def tile_layout(num_warps, cols=4):
    """The layout of a [128, 128] tile on num_warps warps: cols consecutive columns (cols * 2 bytes of bf16 per load)
    x the rest of the tokens per thread, 128 / cols lanes along the columns, the other lanes and the warps along the
    tokens."""
    num_warps, cols = int(num_warps), int(cols)
    lanes_c = 128 // cols
    lanes_t = 32 // lanes_c
    return gl.BlockedLayout([128 // (lanes_t * num_warps), cols], [lanes_t, lanes_c], [num_warps, 1], [1, 0])


@gluon.jit
def expert_tile(offs, E, g, BE: gl.constexpr, NW: gl.constexpr):
    """Token tile g of the per-expert 128-row tiling: (number of tiles, expert e's first tile number, e's rows, e's
    first row, e's expert-major scale block start and rows rounded up to 4). BE // 32 registers x 32 lanes cover the
    experts on warp 0 and the other warps hold copies, so the sums and scans stay inside a warp (spread over the
    warps, each sum cost two CTA barriers)."""
    LE: gl.constexpr = gl.BlockedLayout([BE // 32], [32], [NW], [0])
    o_e = gl.arange(0, BE, layout=LE)
    m_e = o_e < E
    b_end = gl.load(offs + o_e, mask=m_e, other=0)
    b_start = gl.load(offs + o_e - 1, mask=m_e & (o_e > 0), other=0)
    b_cnt = gl.where(m_e, gl.maximum(b_end - b_start, 0), 0)
    b_tiles = (b_cnt + 127) // 128
    b_tile_end = gl.associative_scan(b_tiles, 0, _add)
    sel = o_e == gl.sum((b_tile_end <= g).to(gl.int32), 0)
    b_mp = (b_cnt + 3) // 4 * 4
    return (gl.sum(b_tiles, 0), gl.sum(gl.where(sel, b_tile_end - b_tiles, 0), 0), gl.sum(gl.where(sel, b_cnt, 0), 0),
            gl.sum(gl.where(sel, b_start, 0), 0),
            gl.sum(gl.where(sel, gl.associative_scan(b_mp, 0, _add) - b_mp, 0), 0), gl.sum(gl.where(sel, b_mp, 0), 0))


@gluon.constexpr_function
def lines_layout(num_warps):
    """qT's store layout for whole lines: 16 consecutive tokens x 4 columns per thread, 8 lanes along the tokens
    (128 tokens = one 128-byte line of a qT row), 4 lanes and the warps along the columns."""
    num_warps = int(num_warps)
    return gl.BlockedLayout([16, 128 // (4 * num_warps)], [8, 4], [1, num_warps], [0, 1])


@gluon.jit
def _quant_store_tile(b_x, q, s, qT, sT, rows64, local, m_r, cols, m_c, mask, g, i_k, K, P, nk, stride_qn, base,
                      mp, EXPERT_MAJOR: gl.constexpr, TILES: gl.constexpr, EVEN_K: gl.constexpr):
    """Quantise one fp32 [128, 128] tile (layout tile_layout) into both copies and their scales."""
    G: gl.constexpr = 128
    NW: gl.constexpr = gl.num_warps()
    LT: gl.constexpr = lines_layout(NW)
    b_abs = gl.abs(b_x)
    b_amax_r = gl.max(b_abs, 1)
    b_sr = gl.where(b_amax_r > 0, b_amax_r / 448.0, 1.0)
    # x * (448 / amax): one multiply per element, |q| <= 448 (1 ulp above rounds back to 448), so no clamp
    b_qr = b_x * gl.where(b_amax_r > 0, 448.0 / b_amax_r, 1.0)[:, None]
    gl.store(q + rows64[:, None] * stride_qn + cols[None, :], b_qr.to(q.dtype.element_ty), mask=mask)
    if EXPERT_MAJOR:
        p_s = s + base.to(gl.int64) * nk + i_k * mp + local
    else:
        p_s = s + rows64 * nk + i_k
    gl.store(p_s, b_sr, mask=m_r)
    if TILES:
        b_amax_c = gl.max(b_abs, 0)
        b_sc = gl.where(b_amax_c > 0, b_amax_c / 448.0, 1.0)
        b_qc = (b_x * gl.where(b_amax_c > 0, 448.0 / b_amax_c, 1.0)[None, :]).to(qT.dtype.element_ty)
        gl.store(sT + g.to(gl.int64) * K + cols, b_sc, mask=m_c)
        b_qc = gl.convert_layout(b_qc, LT)  # through shared memory
        toks = g.to(gl.int64) * G + gl.arange(0, G, layout=gl.SliceLayout(1, LT))
        cols_t = i_k * G + gl.arange(0, G, layout=gl.SliceLayout(0, LT))
        p_qT = qT + cols_t.to(gl.int64)[None, :] * P + toks[:, None]
        if EVEN_K:
            gl.store(p_qT, b_qc)
        else:
            gl.store(p_qT, b_qc, mask=(cols_t < K)[None, :])


@gluon.jit
def fp8_quant_dual_gluon_kernel(x, q, s, qT, sT, offs, K, E, P, nk, stride_xn, stride_qn,
                                BE: gl.constexpr, EXPERT_MAJOR: gl.constexpr, TILES: gl.constexpr,
                                EVEN_K: gl.constexpr, COLS: gl.constexpr):
    """One [128 tokens of one expert, 128 columns] tile, as quant.fp8_quant_dual_kernel."""
    G: gl.constexpr = 128
    NW: gl.constexpr = gl.num_warps()
    L: gl.constexpr = tile_layout(NW, COLS)
    g = gl.program_id(0)
    i_k = gl.program_id(1)
    n_tiles, first, cnt, start, base, mp = expert_tile(offs, E, g, BE, NW)
    if g < n_tiles:
        local = (g - first) * G + gl.arange(0, G, layout=gl.SliceLayout(1, L))  # row index inside the expert
        rows64 = (start + local).to(gl.int64)
        m_r = local < cnt
        cols = i_k * G + gl.arange(0, G, layout=gl.SliceLayout(0, L))
        m_c = cols < K
        # row masks only where K is a multiple of 128: one predicate per row instead of one per element
        mask = m_r[:, None] if EVEN_K else m_r[:, None] & m_c[None, :]
        b_x = gl.load(x + rows64[:, None] * stride_xn + cols[None, :], mask=mask, other=0.0).to(gl.float32)
        _quant_store_tile(b_x, q, s, qT, sT, rows64, local, m_r, cols, m_c, mask, g, i_k, K, P, nk, stride_qn,
                          base, mp, EXPERT_MAJOR, TILES, EVEN_K)


def launch(x_NK, qbuf, s, qT, sT, offs_E, P: int, expert_major: bool, tiles: bool) -> None:
    """The quantize_dual launch (same arguments as its Triton kernel's; the caller allocates)."""
    num_warps, cols = CONFIG
    K = x_NK.shape[1]
    E = offs_E.numel()
    nk = -(-K // TILE)
    G = P // TILE
    fp8_quant_dual_gluon_kernel[(G, nk)](
        x_NK, qbuf, s, qT, sT, offs_E, K, E, P, nk, x_NK.stride(0), qbuf.stride(0),
        BE=max(32, 1 << (E - 1).bit_length()), EXPERT_MAJOR=expert_major, TILES=tiles, EVEN_K=K % TILE == 0,
        COLS=cols, num_warps=num_warps)
