"""The experts' GLU activation fused with quantize_dual, in Gluon for sm_90: forward and backward.

FP8 v3 (fp8_grouped_gemm.py) runs two activation kernels whose output is quantised right away:
    forward   a = glu(gate_up)                [N, I]   -> quantize_dual(a)   (the down GEMM's x)
    backward  d_gate_up = glu_bwd(gate_up, da) [N, 2I] -> quantize_dual(d_gate_up)   (the gate/up GEMM's dY)
Here one kernel per direction computes the activation and writes quantize_dual's four outputs directly (q 1x128
row tiles with expert-major scales, qT 128x1 token tiles and their scales): the bf16 write + read of a and of
d_gate_up disappear. The numbers are the unfused path's, bit for bit: the activation in fp32 with the formulas
and operation order of triton_activation.py's kernels, rounded to bf16 (what those kernels store) and back, then
quantize_dual's scaling (x * (448 / amax), no clamp; as gluon_quant.py).

Tiles and layout are gluon_quant.py's (read its docstring): one program per [128 tokens of one expert, 128
columns] tile; each thread holds consecutive tokens x 4 consecutive columns (warps stacked along the tokens), so
the row-major fp8 copy and the transposed token-tile copy are stored from the same registers. The activation runs
on two halves of 64 tokens whose bf16 results are packed two per 32-bit register (a lone bf16 takes a whole one):
forward a(first half) | a(second half), backward dg | du per half. The backward program takes 128 columns of
gate, up and da (loaded once) and writes the dg block (columns c) and the du block (columns I + c) of d_gate_up's
quantisation, one after the other. 16 warps (WARPS has the register counts).

Requirements (`supported_shape`, `supported`): sm_90 with Triton's Gluon, bf16 gate_up / da, I a multiple of 128
(no column masks; raises ValueError otherwise). fp8_ffn.py falls back to the unfused kernels elsewhere. Outputs
are always expert-major with token tiles (the cuBLAS path's layout), as quantize_dual(expert_major=True,
tiles=True). Legend as fp8_quant.py; I expert intermediate width, KIND 0 = situ_glu (beta, lin_beta), 1 = swiglu.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from moestack.ops.moe import fp8_quant as fq

TILE = 128  # fp8_quant.GROUP: the scale groups' edge
# 16 warps: 4 tokens x 4 columns per half and thread; sm_90a (ptxas -v, Triton 3.6): forward 73 / 79 registers
# (situ_glu / swiglu), backward 122 / 119, no spills, one program per SM. At 8 warps ptxas took 160-255 registers
# (backward spilling at a 128 cap): it hoists and interleaves the math of many elements.
WARPS = 16
KINDS = {"situ_glu": 0, "swiglu": 1}  # triton_activation.KINDS


@functools.cache
def supported(device_index: int) -> bool:
    """sm_90 with a Triton that has Gluon's Hopper pieces (imported above)."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def supported_shape(gate_up_N2I: torch.Tensor) -> bool:
    """The shapes and dtypes the kernels take: bf16 [N, 2I] with I a multiple of 128."""
    I2 = gate_up_N2I.shape[-1]
    return gate_up_N2I.dtype == torch.bfloat16 and I2 % (2 * TILE) == 0


# ---------------------------------------------------------------------------------------------------------------
# device helpers


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _tanh(x):
    # triton_activation._tanh: one exp, sign-symmetric (same operations, so the same bits)
    e = gl.exp(-2.0 * gl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return gl.where(x < 0, -t, t)


@gluon.jit
def _pack_bf16(hi, lo):
    """Two fp32 tensors (same layout) rounded to bf16 (round to nearest even, as .to(bfloat16) and the unfused
    kernels' stores) and packed in one 32-bit register each: a lone bf16 value occupies a whole register."""
    return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,r,r", [hi, lo], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _unpack_hi(p):
    return (p & -65536).to(gl.float32, bitcast=True)  # the high bf16 as fp32 (exact)


@gluon.jit
def _unpack_lo(p):
    return (p << 16).to(gl.float32, bitcast=True)  # the low bf16 as fp32 (exact)


@gluon.jit
def _expert_tile(offs, E, g, BE: gl.constexpr, NW: gl.constexpr):
    """Token tile g -> (tiles in all, expert's first row, its row count, g's index inside it, its expert-major
    scale block start in rows, its row count rounded up to 4). As gluon_quant's lookup: the experts on warp 0's
    lanes (BE // 32 each), the other warps holding copies, so sums and scans stay inside a warp."""
    G: gl.constexpr = 128
    LE: gl.constexpr = gl.BlockedLayout([BE // 32], [32], [NW], [0])
    o_e = gl.arange(0, BE, layout=LE)
    m_e = o_e < E
    b_end = gl.load(offs + o_e, mask=m_e, other=0)
    b_start = gl.load(offs + o_e - 1, mask=m_e & (o_e > 0), other=0)
    b_cnt = gl.where(m_e, gl.maximum(b_end - b_start, 0), 0)
    b_tiles = (b_cnt + G - 1) // G
    b_tile_end = gl.associative_scan(b_tiles, 0, _add)
    e = gl.sum((b_tile_end <= g).to(gl.int32), 0)
    sel = o_e == e
    b_mp = (b_cnt + 3) // 4 * 4
    total = gl.sum(b_tiles, 0)
    start = gl.sum(gl.where(sel, b_start, 0), 0)
    cnt = gl.sum(gl.where(sel, b_cnt, 0), 0)
    tile = g - gl.sum(gl.where(sel, b_tile_end - b_tiles, 0), 0)
    base = gl.sum(gl.where(sel, gl.associative_scan(b_mp, 0, _add) - b_mp, 0), 0)
    mp = gl.sum(gl.where(sel, b_mp, 0), 0)
    return total, start, cnt, tile, base, mp


@gluon.jit
def _half_rows(tile, start, cnt, h, L: gl.constexpr):
    """Half h (64 tokens) of token tile `tile` of an expert: (row index inside the expert, global row, row mask)."""
    local = tile * 128 + h * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    return local, (start + local).to(gl.int64), local < cnt


@gluon.jit
def _glu_fwd_half(gu, rows64, m_r, cols, I, stride_gn, beta, lin_beta, KIND: gl.constexpr):
    """a on 64 tokens x 128 columns, as triton_activation.glu_fwd_kernel (formulas and order), rounded to bf16.
    Masked rows load 0 and give a = +0 (as quantize_dual's masked loads)."""
    p_g = gu + rows64[:, None] * stride_gn + cols[None, :]
    b_g = gl.load(p_g, mask=m_r[:, None], other=0.0).to(gl.float32)
    b_u = gl.load(p_g + I, mask=m_r[:, None], other=0.0).to(gl.float32)
    b_sig = 1.0 / (1.0 + gl.exp(-b_g))
    if KIND == 0:
        b_a = beta * _tanh(b_g / beta) * b_sig * (lin_beta * _tanh(b_u / lin_beta))
    else:
        b_a = b_g * b_sig * b_u
    return b_a


@gluon.jit
def _glu_bwd_half(gu, da, rows64, m_r, cols, I, stride_gn, stride_dn, beta, lin_beta, KIND: gl.constexpr):
    """(dg, du) on 64 tokens x 128 columns, as triton_activation.glu_bwd_kernel (formulas and order), rounded to
    bf16 and packed (dg high, du low). Masked rows load da = 0 and give +0."""
    p_g = gu + rows64[:, None] * stride_gn + cols[None, :]
    b_g = gl.load(p_g, mask=m_r[:, None], other=0.0).to(gl.float32)
    b_u = gl.load(p_g + I, mask=m_r[:, None], other=0.0).to(gl.float32)
    b_da = gl.load(da + rows64[:, None] * stride_dn + cols[None, :], mask=m_r[:, None], other=0.0).to(gl.float32)
    b_sig = 1.0 / (1.0 + gl.exp(-b_g))
    if KIND == 0:
        b_tg = _tanh(b_g / beta)
        b_tu = _tanh(b_u / lin_beta)
        b_actg = beta * b_tg * b_sig
        b_dg = b_da * lin_beta * b_tu * ((1.0 - b_tg * b_tg) * b_sig + b_actg * (1.0 - b_sig))
        b_du = b_da * b_actg * (1.0 - b_tu * b_tu)
    else:
        b_dg = b_da * b_u * b_sig * (1.0 + b_g * (1.0 - b_sig))
        b_du = b_da * b_g * b_sig
    return _pack_bf16(b_dg, b_du)


@gluon.jit
def _row_quant_half(b_x, rows64, m_r, local, cols, q, s_blk, mp, kb, stride_qn):
    """1x128 row tiles of 64 tokens: q rows and their expert-major scales (s_blk = the expert's block)."""
    b_amax = gl.max(gl.abs(b_x), 1)
    # x * (448 / amax): one multiply per element, |q| <= 448 (1 ulp above rounds back to 448), so no clamp
    b_q = b_x * gl.where(b_amax > 0, 448.0 / b_amax, 1.0)[:, None]
    gl.store(q + rows64[:, None] * stride_qn + cols[None, :], b_q.to(q.dtype.element_ty), mask=m_r[:, None])
    gl.store(s_blk + kb * mp + local, gl.where(b_amax > 0, b_amax / 448.0, 1.0), mask=m_r)


@gluon.jit
def _tile_quant_half(b_x, b_inv, qT, toks0, col0, P, LT: gl.constexpr):
    """128x1 token tiles, 64 of their tokens: x * (448 / column amax), stored transposed (tokens contiguous)."""
    b_qc = (b_x * b_inv[None, :]).to(qT.dtype.element_ty)
    b_qc = gl.convert_layout(b_qc, LT)  # register renaming only (same lanes and warps)
    toks = toks0 + gl.arange(0, 64, layout=gl.SliceLayout(1, LT))
    cols_t = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, LT))
    gl.store(qT + cols_t.to(gl.int64)[None, :] * P + toks[:, None], b_qc)


@gluon.jit
def _quant_store(x_0, x_1, rows_0, rows_1, m_0, m_1, local_0, local_1, col0, c_off, g, q, s, qT, sT, K, P, nk, s_row0,
                 mp, stride_qn, L: gl.constexpr, LT: gl.constexpr):
    """quantize_dual of one [128 tokens, 128 columns] tile at column c_off + col0, given as its two halves of 64
    tokens (fp32 values of bf16 numbers, layout L): q with its expert-major row
    scales (the expert's block starts at s_row0 * nk, Mp = mp), qT with the token-tile scales sT[g]. c_off moves
    the base pointers only, so two calls at different c_off share their offset tensors (registers)."""
    cols = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, L))
    q = q + c_off
    s_blk = s + s_row0.to(gl.int64) * nk
    kb = (c_off + col0) // 128
    _row_quant_half(x_0, rows_0, m_0, local_0, cols, q, s_blk, mp, kb, stride_qn)
    _row_quant_half(x_1, rows_1, m_1, local_1, cols, q, s_blk, mp, kb, stride_qn)
    b_amax = gl.maximum(gl.max(gl.abs(x_0), 0), gl.max(gl.abs(x_1), 0))
    gl.store(sT + c_off + g.to(gl.int64) * K + cols, gl.where(b_amax > 0, b_amax / 448.0, 1.0))
    b_inv = gl.where(b_amax > 0, 448.0 / b_amax, 1.0)
    toks0 = g.to(gl.int64) * 128
    qT = qT + c_off * P.to(gl.int64)
    _tile_quant_half(x_0, b_inv, qT, toks0, col0, P, LT)
    _tile_quant_half(x_1, b_inv, qT, toks0 + 64, col0, P, LT)


# ---------------------------------------------------------------------------------------------------------------
# kernels


@gluon.jit
def glu_quant_fwd_kernel(gu, q, s, qT, sT, offs, I, E, P, nk, stride_gn, stride_qn, beta, lin_beta,
                         KIND: gl.constexpr, BE: gl.constexpr):
    """Tile (g, i_k): a = glu(gate, up) on columns [128 i_k, 128 i_k + 128) of 128 tokens of one expert, then
    quantize_dual's outputs for a [N, I] (K = I). The activation runs on two halves of 64 tokens whose bf16
    results (what the unfused kernel stores) are packed in pairs."""
    NW: gl.constexpr = gl.num_warps()
    L: gl.constexpr = gl.BlockedLayout([64 // NW, 4], [1, 32], [NW, 1], [1, 0])  # loads, row stores
    LT: gl.constexpr = gl.BlockedLayout([64 // NW, 4], [1, 32], [NW, 1], [0, 1])  # same threads: qT stores
    g = gl.program_id(0)
    i_k = gl.program_id(1)
    total, start, cnt, tile, base, mp = _expert_tile(offs, E, g, BE, NW)
    if g < total:
        col0 = i_k * 128
        cols = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, L))
        local_0, rows_0, m_0 = _half_rows(tile, start, cnt, 0, L)
        local_1, rows_1, m_1 = _half_rows(tile, start, cnt, 1, L)
        a_0 = _glu_fwd_half(gu, rows_0, m_0, cols, I, stride_gn, beta, lin_beta, KIND)
        a_1 = _glu_fwd_half(gu, rows_1, m_1, cols, I, stride_gn, beta, lin_beta, KIND)
        a_01 = _pack_bf16(a_0, a_1)  # the bf16 a the unfused kernel stores, both halves in one register
        _quant_store(_unpack_hi(a_01), _unpack_lo(a_01), rows_0, rows_1, m_0, m_1, local_0, local_1, col0, 0, g,
                     q, s, qT, sT, I, P, nk, base, mp, stride_qn, L, LT)


@gluon.jit
def glu_quant_bwd_kernel(gu, da, q, s, qT, sT, offs, I, E, P, nk, stride_gn, stride_dn, stride_qn, beta,
                         lin_beta, KIND: gl.constexpr, BE: gl.constexpr):
    """Tile (g, i_k): dg and du on columns [128 i_k, 128 i_k + 128) of gate / up and da (loaded once), then
    quantize_dual's outputs for d_gate_up [N, 2I] (K = 2I): the dg block at column 128 i_k, the du block at
    I + 128 i_k. Two halves of 64 tokens, dg and du packed in bf16 pairs."""
    NW: gl.constexpr = gl.num_warps()
    L: gl.constexpr = gl.BlockedLayout([64 // NW, 4], [1, 32], [NW, 1], [1, 0])
    LT: gl.constexpr = gl.BlockedLayout([64 // NW, 4], [1, 32], [NW, 1], [0, 1])
    g = gl.program_id(0)
    i_k = gl.program_id(1)
    total, start, cnt, tile, base, mp = _expert_tile(offs, E, g, BE, NW)
    if g < total:
        col0 = i_k * 128
        cols = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, L))
        local_0, rows_0, m_0 = _half_rows(tile, start, cnt, 0, L)
        local_1, rows_1, m_1 = _half_rows(tile, start, cnt, 1, L)
        # the bf16 dg and du the unfused kernel stores, packed per half as soon as computed
        dgu_0 = _glu_bwd_half(gu, da, rows_0, m_0, cols, I, stride_gn, stride_dn, beta, lin_beta, KIND)
        dgu_1 = _glu_bwd_half(gu, da, rows_1, m_1, cols, I, stride_gn, stride_dn, beta, lin_beta, KIND)
        _quant_store(_unpack_hi(dgu_0), _unpack_hi(dgu_1), rows_0, rows_1, m_0, m_1, local_0, local_1, col0, 0, g,
                     q, s, qT, sT, 2 * I, P, nk, base, mp, stride_qn, L, LT)
        _quant_store(_unpack_lo(dgu_0), _unpack_lo(dgu_1), rows_0, rows_1, m_0, m_1, local_0, local_1, col0, I, g,
                     q, s, qT, sT, 2 * I, P, nk, base, mp, stride_qn, L, LT)


# ---------------------------------------------------------------------------------------------------------------
# launches


def _check(gate_up_N2I: torch.Tensor, offs_E: torch.Tensor, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"activation must be one of {tuple(KINDS)}, got {kind!r}")
    if gate_up_N2I.dim() != 2 or not supported_shape(gate_up_N2I):
        raise ValueError(f"gluon_glu_quant needs bf16 gate_up [N, 2I] with I % {TILE} == 0; got "
                         f"{gate_up_N2I.dtype} {tuple(gate_up_N2I.shape)}")
    if gate_up_N2I.stride(1) != 1 or offs_E.dtype != torch.int32:
        raise ValueError("gluon_glu_quant needs gate_up with contiguous rows and int32 offsets")


def _outputs(N: int, K: int, E: int, device: torch.device):
    """quantize_dual(expert_major=True, tiles=True)'s buffers: q [N + 3, K] (zero rows past N), s, qT, sT, P."""
    nk = K // TILE
    qbuf = torch.empty((N + 3, K), device=device, dtype=fq.FP8)
    qbuf[N:].zero_()
    s = torch.zeros(nk * (N + 3 * E), device=device, dtype=torch.float32)
    G = fq.num_token_tiles(N, E)
    qT = torch.empty((K, G * TILE), device=device, dtype=fq.FP8)
    sT = torch.empty((G, K), device=device, dtype=torch.float32)
    return qbuf, s, qT, sT, G * TILE


def _block_experts(E: int) -> int:
    return max(32, 1 << (E - 1).bit_length())


def glu_quant_fwd(gate_up_N2I: torch.Tensor, offs_E: torch.Tensor, kind: str = "situ_glu", beta: float = 4.0,
                  lin_beta: float = 25.0, num_warps: int = WARPS, maxnreg: int | None = None):
    """quantize_dual(fused_glu(gate_up), offs, expert_major=True, tiles=True) in one pass: (q [N, I] a view of an
    [N + 3, I] buffer, s expert-major, qT [I, P], sT [G, I]); bytes equal to the unfused path's. maxnreg=64 fits
    two 16-warp programs per SM (situ_glu then spills 4 bytes; unmeasured)."""
    _check(gate_up_N2I, offs_E, kind)
    N, I = gate_up_N2I.shape[0], gate_up_N2I.shape[1] // 2
    E = offs_E.numel()
    qbuf, s, qT, sT, P = _outputs(N, I, E, gate_up_N2I.device)
    if N:
        glu_quant_fwd_kernel[(P // TILE, I // TILE)](
            gate_up_N2I, qbuf, s, qT, sT, offs_E, I, E, P, I // TILE, gate_up_N2I.stride(0), qbuf.stride(0),
            float(beta), float(lin_beta), KIND=KINDS[kind], BE=_block_experts(E), num_warps=num_warps,
            maxnreg=maxnreg)
    return qbuf[:N], s, qT, sT


def glu_quant_bwd(gate_up_N2I: torch.Tensor, da_NI: torch.Tensor, offs_E: torch.Tensor, kind: str = "situ_glu",
                  beta: float = 4.0, lin_beta: float = 25.0, num_warps: int = WARPS):
    """quantize_dual(glu_bwd(gate_up, da), offs, expert_major=True, tiles=True) in one pass, for d_gate_up
    [N, 2I] (gate columns, then up columns): (q [N, 2I] view, s, qT [2I, P], sT [G, 2I])."""
    _check(gate_up_N2I, offs_E, kind)
    N, I = gate_up_N2I.shape[0], gate_up_N2I.shape[1] // 2
    if da_NI.shape != (N, I) or da_NI.dtype != torch.bfloat16 or da_NI.stride(1) != 1:
        raise ValueError(f"da must be bf16 [{N}, {I}] with contiguous rows; got {da_NI.dtype} {tuple(da_NI.shape)}")
    E = offs_E.numel()
    qbuf, s, qT, sT, P = _outputs(N, 2 * I, E, gate_up_N2I.device)
    if N:
        glu_quant_bwd_kernel[(P // TILE, I // TILE)](
            gate_up_N2I, da_NI, qbuf, s, qT, sT, offs_E, I, E, P, 2 * I // TILE, gate_up_N2I.stride(0),
            da_NI.stride(0), qbuf.stride(0), float(beta), float(lin_beta), KIND=KINDS[kind], BE=_block_experts(E),
            num_warps=num_warps)
    return qbuf[:N], s, qT, sT
