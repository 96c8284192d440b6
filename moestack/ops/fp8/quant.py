"""FP8 e4m3 quantisation in Triton (fine-grained scales, DeepSeek-V3 style); the torch spec is reference.py.

Three groupings, each with one fp32 scale = amax(|group|) / 448 (1 for an all-zero group), q = x / scale in e4m3
(reference.py has the layouts):
    rows 1x128      x [N, K] -> q [N, K], s [N, ceil(K/128)]            activations along the reduction dim
    blocks 128x128  w [E, K, F] -> q [E, K, F] (K contiguous), s [E, ceil(K/128), ceil(F/128)]   weights
    token tiles 128x1 along each expert's tokens: x [N, D], offs -> qT [D, P], s [G, D]   the weight gradient's
                    operands (the reduction runs over each expert's tokens)
`quantize_dual` reads x once per 128x128 tile of one expert and writes both the 1x128 row tiles (forward / dX
operand) and the 128x1 token tiles (wgrad operand): on sm_90 by gluon_quant.py (1.6x faster on the H200), elsewhere
and under the interpreter by its Triton kernel here (the same bytes). `quantize_blocks_pair` reads w once per
128x128 block and writes both weight layouts (w and w^T, each with its reduction dim contiguous).
`quantize_dual(expert_major=True)` writes the row scales expert by expert, each expert's block [ceil(K/128), Mp_e]
contiguous (Mp_e = its row count rounded up to 4): the layout torch._scaled_mm's 1x128 recipe takes for one expert's
rows (scaled_mm.py); padding entries are zero. `quantize_rows` (1x128 tiles of any [N, K]) is also the FP8
activation-storage format of moestack/memory/precision.py.

`out_dtype=torch.float32` makes the kernels write the unrounded x / scale (the interpreter tests: its fp8 casts
round wrongly).

Legend: N rows, K reduction width, F output width, E experts, D width, G token tiles, P = 128 G padded tokens.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch
import triton
import triton.language as tl

from moestack.ops.fp8.reference import FP8, GROUP, num_token_tiles

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def fp8_quant_rows_kernel(x, q, s, N, K, stride_xn, stride_qn, stride_sn, BM: tl.constexpr, G: tl.constexpr):
    i_m, i_k = tl.program_id(0), tl.program_id(1)
    rows = i_m * BM + tl.arange(0, BM)
    cols = i_k * G + tl.arange(0, G)
    m_r = rows < N
    mask = m_r[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    b_x = tl.load(x + rows64[:, None] * stride_xn + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [BM, G]
    b_amax = tl.max(tl.abs(b_x), 1)
    b_s = tl.where(b_amax > 0, b_amax / 448.0, 1.0)  # [BM]
    b_q = tl.clamp(b_x / b_s[:, None], -448.0, 448.0)
    tl.store(q + rows64[:, None] * stride_qn + cols[None, :], b_q.to(q.dtype.element_ty), mask=mask)
    tl.store(s + rows64 * stride_sn + i_k, b_s, mask=m_r)


@triton.jit
def fp8_quant_blocks_kernel(
    w, q, s, K, F, stride_we, stride_wk, stride_wf, stride_qe, stride_qk, stride_qf, G: tl.constexpr
):
    i_k, i_f, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    nk, nf = tl.cdiv(K, G), tl.cdiv(F, G)
    o_k = i_k * G + tl.arange(0, G)
    o_f = i_f * G + tl.arange(0, G)
    mask = (o_k < K)[:, None] & (o_f < F)[None, :]
    e64 = e.to(tl.int64)
    b_w = tl.load(w + e64 * stride_we + o_k[:, None] * stride_wk + o_f[None, :] * stride_wf, mask=mask,
                  other=0.0).to(tl.float32)  # [G, G]
    b_amax = tl.max(tl.max(tl.abs(b_w), 1), 0)
    b_s = tl.where(b_amax > 0, b_amax / 448.0, 1.0)
    b_q = tl.clamp(b_w / b_s, -448.0, 448.0)
    tl.store(q + e64 * stride_qe + o_k[:, None] * stride_qk + o_f[None, :] * stride_qf, b_q.to(q.dtype.element_ty),
             mask=mask)
    tl.store(s + (e64 * nk + i_k) * nf + i_f, b_s)


@triton.jit
def _quant_store_tile(b_x, q, s, qT, sT, rows64, local, m_r, cols, m_c, g, i_k, K, P, nk, stride_qn, base, mp,
                      G: tl.constexpr, EXPERT_MAJOR: tl.constexpr, TILES: tl.constexpr):
    """Quantise one fp32 [G, G] tile (columns i_k of the output, token tile g) into both copies and their scales."""
    b_amax_r = tl.max(tl.abs(b_x), 1)  # |x| recomputed below rather than kept: two [G, G] fp32 tiles at most
    b_sr = tl.where(b_amax_r > 0, b_amax_r / 448.0, 1.0)  # [G] one scale per row
    # x * (448 / amax) rather than x / scale: one multiply per element (as gluon_quant.py, bitwise equal);
    # |q| <= 448 up to one ulp, which the fp8 cast rounds back to 448, so no clamp
    b_qr = b_x * tl.where(b_amax_r > 0, 448.0 / b_amax_r, 1.0)[:, None]
    tl.store(q + rows64[:, None] * stride_qn + cols[None, :], b_qr.to(q.dtype.element_ty),
             mask=m_r[:, None] & m_c[None, :])
    if EXPERT_MAJOR:
        p_s = s + base.to(tl.int64) * nk + i_k * mp + local
    else:
        p_s = s + rows64 * nk + i_k
    tl.store(p_s, b_sr, mask=m_r)
    if TILES:
        b_amax_c = tl.max(tl.abs(b_x), 0)
        b_sc = tl.where(b_amax_c > 0, b_amax_c / 448.0, 1.0)  # [G] one scale per column of the tile
        b_qc = b_x * tl.where(b_amax_c > 0, 448.0 / b_amax_c, 1.0)[None, :]
        toks = g.to(tl.int64) * G + tl.arange(0, G)  # token positions in qT; rows past the expert are zeros
        tl.store(qT + cols.to(tl.int64)[None, :] * P + toks[:, None], b_qc.to(qT.dtype.element_ty),
                 mask=m_c[None, :])
        tl.store(sT + g.to(tl.int64) * K + cols, b_sc, mask=m_c)


@triton.jit
def fp8_quant_dual_kernel(x, q, s, qT, sT, offs, K, E, P, nk, stride_xn, stride_qn,
                          BE: tl.constexpr, G: tl.constexpr, EXPERT_MAJOR: tl.constexpr, TILES: tl.constexpr):
    """One [G tokens of one expert, G columns] tile: 1x128 row scales (along K) and 128x1 token scales."""
    g, i_k = tl.program_id(0), tl.program_id(1)
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    b_end = tl.load(offs + o_e, mask=m_e, other=0)
    b_start = tl.load(offs + o_e - 1, mask=m_e & (o_e > 0), other=0)
    b_cnt = tl.where(m_e, tl.maximum(b_end - b_start, 0), 0)
    b_tiles = (b_cnt + G - 1) // G
    b_tile_end = tl.cumsum(b_tiles, 0)
    if g < tl.sum(b_tiles, 0):
        e = tl.sum((b_tile_end <= g).to(tl.int32), 0)
        sel = o_e == e
        first = tl.sum(tl.where(sel, b_tile_end - b_tiles, 0), 0)
        local = (g - first) * G + tl.arange(0, G)  # [G] row index inside expert e
        rows = tl.sum(tl.where(sel, b_start, 0), 0) + local
        m_r = local < tl.sum(tl.where(sel, b_cnt, 0), 0)
        rows64 = rows.to(tl.int64)
        b_mp = (b_cnt + 3) // 4 * 4
        base = tl.sum(tl.where(sel, tl.cumsum(b_mp, 0) - b_mp, 0), 0)  # expert-major scale block (EXPERT_MAJOR)
        mp = tl.sum(tl.where(sel, b_mp, 0), 0)
        cols = i_k * G + tl.arange(0, G)  # [G] output columns
        m_c = cols < K
        b_x = tl.load(x + rows64[:, None] * stride_xn + cols[None, :], mask=m_r[:, None] & m_c[None, :],
                      other=0.0).to(tl.float32)  # [G, G]
        _quant_store_tile(b_x, q, s, qT, sT, rows64, local, m_r, cols, m_c, g, i_k, K, P, nk, stride_qn, base,
                          mp, G, EXPERT_MAJOR, TILES)


@triton.jit
def fp8_quant_blocks_pair_kernel(
    w, q, s, qT, sT, K, F, stride_we, stride_wk, stride_wf, stride_qe, stride_qk, stride_qf,
    stride_te, stride_tk, stride_tf, G: tl.constexpr
):
    """One 128x128 block of w [E, K, F]: q (w's layout, K contiguous), qT (w^T's, F contiguous), s [E, nk, nf],
    sT [E, nf, nk] (the same numbers transposed). 16-bit weights only (quantize_blocks_pair)."""
    i_k, i_f, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    nk, nf = tl.cdiv(K, G), tl.cdiv(F, G)
    o_k = i_k * G + tl.arange(0, G)
    o_f = i_f * G + tl.arange(0, G)
    mask = (o_k < K)[:, None] & (o_f < F)[None, :]
    e64 = e.to(tl.int64)
    b_w = tl.load(w + e64 * stride_we + o_k[:, None] * stride_wk + o_f[None, :] * stride_wf, mask=mask,
                  other=0.0).to(tl.float32)  # [G, G]
    b_amax = tl.max(tl.max(tl.abs(b_w), 1), 0)
    b_s = tl.where(b_amax > 0, b_amax / 448.0, 1.0)
    b_q = tl.clamp(b_w / b_s, -448.0, 448.0).to(q.dtype.element_ty)
    tl.store(q + e64 * stride_qe + o_k[:, None] * stride_qk + o_f[None, :] * stride_qf, b_q, mask=mask)
    tl.store(qT + e64 * stride_te + o_k[:, None] * stride_tk + o_f[None, :] * stride_tf, b_q, mask=mask)
    tl.store(s + (e64 * nk + i_k) * nf + i_f, b_s)
    tl.store(sT + (e64 * nf + i_f) * nk + i_k, b_s)


def quantize_dual(
    x_NK: torch.Tensor, offs_E: torch.Tensor, out_dtype: torch.dtype = FP8, expert_major: bool = False,
    tiles: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One read of x [N, K] (rows sorted by expert, offs int32 [E]) -> (q, s, qT, sT):
    q [N, K] 1x128 row tiles (a view of an [N + 3, K] buffer: the rows past N exist so that one expert's rows
    can be read rounded up to 4, and are zero), s the row scales, [N, ceil(K/128)] or (expert_major) the flat
    expert-major layout (module doc); qT [K, P], sT [G, K] the 128x1 token tiles of
    reference.quantize_token_tiles_ref (None when tiles=False). Rows at or past offs[-1] are not quantised (never
    read by the GEMMs)."""
    x = x_NK.contiguous()
    N, K = x.shape
    E = offs_E.numel()
    nk = triton.cdiv(K, GROUP)
    qbuf = torch.empty((N + 3, K), device=x.device, dtype=out_dtype)
    qbuf[N:].zero_()
    if expert_major:
        s = torch.zeros(nk * (N + 3 * E), device=x.device, dtype=torch.float32)
    else:
        s = torch.empty((N, nk), device=x.device, dtype=torch.float32)
    G = num_token_tiles(N, E)
    P = G * GROUP
    if tiles:
        qT = torch.empty((K, P), device=x.device, dtype=out_dtype)
        sT = torch.empty((G, K), device=x.device, dtype=torch.float32)
    else:
        qT, sT = qbuf, s  # placeholders, never written (TILES=False)
    gluon_quant = gluon_module("gluon_quant", x.device) if x.is_cuda and N else None
    if gluon_quant is not None:
        gluon_quant.launch(x, qbuf, s, qT, sT, offs_E, P, expert_major, tiles)
    elif N:
        fp8_quant_dual_kernel[(G, nk)](
            x, qbuf, s, qT, sT, offs_E, K, E, P, nk, x.stride(0), qbuf.stride(0),
            BE=triton.next_power_of_2(E), G=GROUP, EXPERT_MAJOR=expert_major, TILES=tiles,
            num_warps=16 if tiles else 8)  # sm_90a: 93 / 48 registers, no spills (170 at 8 warps with tiles)
    return qbuf[:N], s, (qT if tiles else None), (sT if tiles else None)


def gluon_module(name: str, device: torch.device):
    """moestack.ops.fp8.<name>, a Gluon (sm_90) kernel module, where it runs on device; else None (the Triton
    kernel runs)."""
    return _gluon_module(name, device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _gluon_module(name: str, device_index: int):
    try:
        module = importlib.import_module(f"moestack.ops.fp8.{name}")
    except ImportError:  # a Triton without Gluon's Hopper pieces
        return None
    from moestack.ops.fp8 import gluon_quant

    return module if gluon_quant.supported(device_index) else None


def quantize_blocks_pair(
    w_EKF: torch.Tensor, out_dtype: torch.dtype = FP8
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """One read of w -> (quantize_blocks(w), quantize_blocks(w^T)): ((q [E, K, F] K contiguous, s [E, nk, nf]),
    (qT [E, F, K] F contiguous, sT [E, nf, nk])). Same values; sT = s^T."""
    E, K, F = w_EKF.shape
    nk, nf = triton.cdiv(K, GROUP), triton.cdiv(F, GROUP)
    qT = torch.empty((E, K, F), device=w_EKF.device, dtype=out_dtype).transpose(1, 2)
    sT = torch.empty((E, nf, nk), device=w_EKF.device, dtype=torch.float32)
    if w_EKF.element_size() != 2:
        # The fused transposed store is for 16-bit weights only: from fp32 weights it wrote a wrong qT on the H200
        # (Triton 3.6; the interpreter exact). There quantize_blocks gives w's layout and qT is its byte transpose
        # (transpose_bytes: a tiled kernel, ~27 ms per K3-slice step faster than torch's strided copy of the 1-byte
        # values), sT the scales' transpose.
        q, s = quantize_blocks(w_EKF, out_dtype)
        # q [E, K, F] is a view of a contiguous [E, F, K]; qT's storage is the contiguous [E, K, F]
        transpose_bytes(q.transpose(1, 2), qT.transpose(1, 2))
        sT.copy_(s.transpose(1, 2))
        return (q, s), (qT, sT)
    q = torch.empty((E, F, K), device=w_EKF.device, dtype=out_dtype).transpose(1, 2)
    s = torch.empty((E, nk, nf), device=w_EKF.device, dtype=torch.float32)
    if E and K and F:
        qTv = qT.transpose(1, 2)  # [E, K, F] view: strides to store a w-indexed block
        fp8_quant_blocks_pair_kernel[(nk, nf, E)](
            w_EKF, q, s, qT, sT, K, F, *w_EKF.stride(), *q.stride(), *qTv.stride(), G=GROUP,
            num_warps=16)  # sm_90a: 120 registers from bf16, no spills (211 at 8 warps)
    return (q, s), (qT, sT)


@triton.jit
def transpose_bytes_kernel(src, dst, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """dst[e, c, r] = src[e, r, c] for contiguous [E, R, C] / [E, C, R] tensors of 1- or 4-byte elements."""
    pid_r, pid_c, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = pid_r * BR + tl.arange(0, BR)
    c = pid_c * BC + tl.arange(0, BC)
    base = e.to(tl.int64) * R * C
    m = (r[:, None] < R) & (c[None, :] < C)
    tile = tl.load(src + base + r[:, None] * C + c[None, :], mask=m)
    tl.store(dst + base + c[:, None] * R + r[None, :], tl.trans(tile), mask=tl.trans(m))


def transpose_bytes(src: torch.Tensor, dst: torch.Tensor, kernel: bool | None = None) -> None:
    """dst = src^T per leading index, both contiguous 3-D ([E, R, C] -> [E, C, R]); fp8 values move as bytes.
    kernel: None = the Triton kernel on CUDA, torch's copy elsewhere (the interpreter would take minutes on the CPU
    tests' weights; tests pass kernel=True on small shapes)."""
    E, R, C = src.shape
    assert src.is_contiguous() and dst.is_contiguous() and dst.shape == (E, C, R) and src.dtype == dst.dtype
    if not (E and R and C):
        return
    if not (src.is_cuda if kernel is None else kernel):
        dst.copy_(src.transpose(1, 2))
        return
    a, b = (src.view(torch.uint8), dst.view(torch.uint8)) if src.element_size() == 1 else (src, dst)
    BR = BC = 16 if INTERPRET else 128
    transpose_bytes_kernel[(triton.cdiv(R, BR), triton.cdiv(C, BC), E)](a, b, R, C, BR=BR, BC=BC, num_warps=8)


def quantize_rows(x_NK: torch.Tensor, out_dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along the last dim: q [N, K] (out_dtype), s [N, ceil(K/128)] fp32."""
    x_NK = x_NK.contiguous()
    N, K = x_NK.shape
    q = torch.empty((N, K), device=x_NK.device, dtype=out_dtype)
    s = torch.empty((N, triton.cdiv(K, GROUP)), device=x_NK.device, dtype=torch.float32)
    if N:
        BM = 32
        fp8_quant_rows_kernel[(triton.cdiv(N, BM), triton.cdiv(K, GROUP))](
            x_NK, q, s, N, K, x_NK.stride(0), q.stride(0), s.stride(0), BM=BM, G=GROUP, num_warps=4)
    return q, s


def quantize_blocks(w_EKF: torch.Tensor, out_dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks: q [E, K, F] with K (the reduction dim) contiguous, s [E, ceil(K/128), ceil(F/128)] fp32.
    w may be any strided view (pass w^T for the input gradient: same blocks, transposed)."""
    E, K, F = w_EKF.shape
    if w_EKF.element_size() == 4 and w_EKF.stride(1) != 1 and w_EKF.stride(2) == 1 and E and K and F:
        # a transposing store from fp32 (F contiguous in, K contiguous out) is what went wrong on the H200
        # (quantize_blocks_pair): quantise w^T in its own layout, then copy the blocks across in torch
        qa, sa = quantize_blocks(w_EKF.transpose(1, 2), out_dtype)
        q = torch.empty((E, F, K), device=w_EKF.device, dtype=out_dtype).transpose(1, 2)
        transpose_bytes(qa.transpose(1, 2), q.transpose(1, 2))  # contiguous [E, K, F] -> contiguous [E, F, K]
        return q, sa.transpose(1, 2).contiguous()
    q = torch.empty((E, F, K), device=w_EKF.device, dtype=out_dtype).transpose(1, 2)
    nk, nf = triton.cdiv(K, GROUP), triton.cdiv(F, GROUP)
    s = torch.empty((E, nk, nf), device=w_EKF.device, dtype=torch.float32)
    fp8_quant_blocks_kernel[(nk, nf, E)](
        w_EKF, q, s, K, F, *w_EKF.stride(), *q.stride(), G=GROUP, num_warps=8)
    return q, s
