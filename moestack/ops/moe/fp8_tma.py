"""FP8 grouped GEMM (forward / dX) with TMA tensor descriptors, for tens to hundreds of rows per expert (v3 option).

    y[rows of e] = sum over 128-slices k of (qx[rows, k] @ qw[e][k, :]) * sx[row, k] * sw[e, k, col // 128]

The pointer-based kernels of fp8_grouped_gemm.py hold their operand addresses in registers ([BM, BK] and [BK, BN]
int64 pointer tensors: 250-255 registers per thread at every config, sm_90a report), which leaves no room for a
deeper pipeline. Here both operands arrive by TMA (host TensorDescriptors, block shapes set per autotune config by
a pre-hook), so a stage is two bulk copies and the registers hold only the two fp32 tiles (the running sum and the
current 128-slice product).

- Token tiles BT < 64: swap-AB, as fp8_grouped_gemm's swap kernel: acc [BF, BT] = w-tile [BF, 128] @ x-tile^T
  [128, BT]. BT >= 64: acc [BT, BF] = x-tile @ w-tile^T, so the per-token scale varies along accumulator rows (a
  few registers per thread) instead of columns (BT / 4 per thread: 248-255 registers and spills at BT 64 / 128).
  Both operands K-major in shared memory (what fp8 wgmma takes); BF divides 128, so the weight scale is one
  scalar per tile and 128-slice, the activation scale a [BT] vector.
- The weight is the 2D view [E * F, K] of the cached fp8 weight (K contiguous: memory [E, F, K], as fp8_quant and
  fp8_weight_cache lay both layouts out). A tile past an expert's F (F % BF != 0) reads expert e + 1's rows into
  output columns >= F (masked); x rows past the expert's end land in masked output rows; K past the end and rows
  past N are zero-filled by TMA.
- Schedule: the persistent work list of triton_grouped_gemm ((expert, f-tile, token-tile) from offs in registers,
  no host sync), 2 programs per SM.

Weight gradient (MOESTACK_FP8_TMA_WGRAD=1, separate switch): out[e, a, b] = sum over e's 128-token tiles g of
(P[a, g-tile] @ Q[b, g-tile]^T) * sP[g, a] * sQ[g, b], from the token-tile operands of fp8_quant (qT [width, P]:
tokens contiguous, so both TMA tiles are K-major), with b the contiguous dimension of the gradient (P, Q = dY, X
for Experts' [E, F, D] parameter layout, X, dY for a contiguous [E, D, F]); one program per (a-tile, b-tile,
expert), the expert's token tiles pipelined by TMA.

Legend: N rows, E experts, K reduction width, F output width, BT token tile, BF weight-column tile, A / B the
weight gradient's row / contiguous width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moestack.ops.moe import fp8_quant as fq
from moestack.ops.moe.triton_grouped_gemm import (
    INTERPRET,
    _expert_tiles,
    _num_programs,
    _pick,
    _precision,
    empty_grad_like,
    quick_bench,
    swap_token_tile,
)

# (BT, BF, warps, stages) per BT_MAX (mean rows per expert as a power of two, 16..128). Shared memory per program
# = stages * (BT + BF) * 128 B: BT = 128, BF = 128: 32 KB per stage.
# BT < 64 runs swap-AB, BT >= 64 tokens-on-M (sm_90a, no spills: BT 16 / 32 swap 77-86 / 165 registers;
# BT 64 at 8 warps 117 (two programs per SM), BT 128 at 8 warps 216; swap at BT 64 / 128 needed 248 / 255 + spills
# because a per-column scale costs BT / 4 registers per thread).
CONFIGS = {
    16: [(16, 128, 4, 4), (16, 128, 4, 6)],
    32: [(32, 128, 4, 4), (32, 128, 4, 6)],
    64: [(64, 128, 8, 4), (32, 128, 4, 4)],
    128: [(64, 128, 8, 4), (128, 128, 8, 3), (128, 128, 8, 4)],
}


def _configs() -> list[triton.Config]:
    if INTERPRET:  # one config (the autotuner cannot time several here); BT passed by the caller, per branch
        return [triton.Config({"BF": 32}, num_warps=4, num_stages=1, pre_hook=_blocks)]
    shapes = sorted({c for cs in CONFIGS.values() for c in cs})
    return [triton.Config({"BT": t, "BF": f}, num_warps=w, num_stages=s, pre_hook=_blocks) for t, f, w, s in shapes]


def _blocks(nargs) -> None:
    """Autotune pre-hook: the descriptors' block shapes follow the config."""
    nargs["x_desc"].block_shape = [nargs["BT"], nargs["BK"]]
    nargs["w_desc"].block_shape = [nargs["BF"], nargs["BK"]]


def _prune(configs, named_args, **kwargs):
    if INTERPRET:
        return configs
    want = CONFIGS[{**named_args, **kwargs}["BT_MAX"]]
    keep = [c for c in configs if (c.kwargs["BT"], c.kwargs["BF"], c.num_warps, c.num_stages) in want]
    return keep or configs[:1]


@triton.autotune(configs=_configs(), key=["K", "F", "E", "BT_MAX"], do_bench=quick_bench,
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["N", "E", "BT_MAX"])
def fp8_gg_fwd_kernel_tma(
    x_desc, w_desc, sx, sw, y, offs, N, K, F, E, stride_sxn, stride_swe, stride_swk, stride_yn, BT_MAX,
    BE: tl.constexpr, PRECISION: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr,
):
    """One (expert, f-tile, token-tile) work item at a time into y [N, F]; rows >= offs[-1] get zeros."""
    tl.static_assert(BK % BF == 0)
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    o_e = tl.arange(0, BE)
    b_start, b_end, b_tiles, b_tile_end = _expert_tiles(offs, E, o_e, BT)
    n_ftiles = tl.cdiv(F, BF)
    b_work_end = b_tile_end * n_ftiles
    total = tl.sum(b_tiles, 0) * n_ftiles
    o_t, o_f = tl.arange(0, BT), tl.arange(0, BF)
    for t in range(pid, total, nprog):
        e = tl.sum((b_work_end <= t).to(tl.int32), 0)
        sel = o_e == e
        tiles_e = _pick(b_tiles, sel)
        local = t - (_pick(b_work_end, sel) - tiles_e * n_ftiles)
        i_f, i_t = local // tiles_e, local % tiles_e
        row0 = _pick(b_start, sel) + i_t * BT
        rows = row0 + o_t  # [BT]
        m_rows = rows < _pick(b_end, sel)
        f0 = i_f * BF
        p_sx = sx + rows.to(tl.int64) * stride_sxn  # [BT]
        p_sw = sw + e.to(tl.int64) * stride_swe + f0 // BK  # one weight block column per tile
        cols = f0 + o_f  # [BF]
        if BT < 64:  # swap-AB: tokens on the MMA's N side (wgmma needs M >= 64)
            b_acc = tl.zeros((BF, BT), dtype=tl.float32)
            for kb in range(tl.cdiv(K, BK)):
                b_x = x_desc.load([row0, kb * BK])  # [BT, BK]
                b_w = w_desc.load([e * F + f0, kb * BK])  # [BF, BK]
                b_s = tl.load(p_sx + kb, mask=m_rows, other=0.0) * tl.load(p_sw + kb * stride_swk)  # [BT]
                b_acc += tl.dot(b_w, tl.trans(b_x), input_precision=PRECISION) * b_s[None, :]
            p_y = y + rows.to(tl.int64)[None, :] * stride_yn + cols[:, None]
            tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=(cols < F)[:, None] & m_rows[None, :])
        else:  # tokens on M: the per-token scale is per accumulator row (a few values per thread, not BT / 4)
            b_acc = tl.zeros((BT, BF), dtype=tl.float32)
            for kb in range(tl.cdiv(K, BK)):
                b_x = x_desc.load([row0, kb * BK])  # [BT, BK]
                b_w = w_desc.load([e * F + f0, kb * BK])  # [BF, BK]
                b_s = tl.load(p_sx + kb, mask=m_rows, other=0.0) * tl.load(p_sw + kb * stride_swk)  # [BT]
                b_acc += tl.dot(b_x, tl.trans(b_w), input_precision=PRECISION) * b_s[:, None]
            p_y = y + rows.to(tl.int64)[:, None] * stride_yn + cols[None, :]
            tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_rows[:, None] & (cols < F)[None, :])
    used = tl.load(offs + E - 1)
    for t in range(pid, tl.cdiv(N - used, BT) * n_ftiles, nprog):
        rows = used + (t // n_ftiles) * BT + o_t
        cols = (t % n_ftiles) * BF + o_f
        p_y = y + rows.to(tl.int64)[None, :] * stride_yn + cols[:, None]
        tl.store(p_y, tl.zeros((BF, BT), dtype=y.dtype.element_ty), mask=(cols < F)[:, None] & (rows < N)[None, :])


def _wgrad_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BA": 16, "BB": 32}, num_warps=4, num_stages=1, pre_hook=_wgrad_blocks)]
    shapes = [(128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 4)]  # (BA, BB, warps, stages)
    return [triton.Config({"BA": a, "BB": b}, num_warps=w, num_stages=st, pre_hook=_wgrad_blocks)
            for a, b, w, st in shapes]


def _wgrad_blocks(nargs) -> None:
    nargs["p_desc"].block_shape = [nargs["BA"], nargs["G"]]
    nargs["q_desc"].block_shape = [nargs["BB"], nargs["G"]]


@triton.autotune(configs=_wgrad_configs(), key=["A", "B", "E", "BT_MAX"], do_bench=quick_bench)
@triton.jit(do_not_specialize=["E", "BT_MAX"])
def fp8_gg_wgrad_kernel_tma(
    p_desc, q_desc, sp, sq, out, offs, A, B, E, stride_oe, stride_oa, BT_MAX,
    BE: tl.constexpr, PRECISION: tl.constexpr, G: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
):
    """out[e, a-tile, b-tile] (b contiguous) over expert e's token tiles; zeros for an empty expert."""
    i_t, e = tl.program_id(0), tl.program_id(1)
    n_b = tl.cdiv(B, BB)
    i_a, i_b = i_t // n_b, i_t % n_b
    o_e = tl.arange(0, BE)
    _, _, b_tiles, b_tile_end = _expert_tiles(offs, E, o_e, G)
    sel = o_e == e
    g_end = _pick(b_tile_end, sel)
    g_start = g_end - _pick(b_tiles, sel)
    o_a = i_a * BA + tl.arange(0, BA)
    o_b = i_b * BB + tl.arange(0, BB)
    m_a, m_b = o_a < A, o_b < B
    b_acc = tl.zeros((BA, BB), dtype=tl.float32)
    for g in range(g_start, g_end):
        b_p = p_desc.load([i_a * BA, g * G])  # [BA, G]
        b_q = q_desc.load([i_b * BB, g * G])  # [BB, G]
        b_sp = tl.load(sp + g * A + o_a, mask=m_a, other=0.0)  # [BA]; g * A < 2^31 (tiles x width)
        b_sq = tl.load(sq + g * B + o_b, mask=m_b, other=0.0)  # [BB]
        b_acc += tl.dot(b_p, tl.trans(b_q), input_precision=PRECISION) * b_sp[:, None] * b_sq[None, :]
    p_o = out + e.to(tl.int64) * stride_oe + o_a.to(tl.int64)[:, None] * stride_oa + o_b[None, :]
    tl.store(p_o, b_acc.to(out.dtype.element_ty), mask=m_a[:, None] & m_b[None, :])


def wgrad_supported(qxT: torch.Tensor, qdyT: torch.Tensor) -> bool:
    """Token-tile operands a TMA descriptor covers (contiguous [width, P], 16-byte aligned)."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[1] * t.element_size()) % 16 == 0
               and (INTERPRET or t.is_cuda) for t in (qxT, qdyT))


def wgrad(qxT: torch.Tensor, sx: torch.Tensor, qdyT: torch.Tensor, sdy: torch.Tensor, offs_E: torch.Tensor,
          like: torch.Tensor) -> torch.Tensor:
    """dw [E, D, F] from the 128x1 token tiles of x (qxT [D, P], sx [G, D]) and dy (qdyT [F, P], sdy [G, F]);
    in like's dtype and layout (the transposed view of [E, F, D] when like is one, else contiguous [E, D, F]);
    zero for empty experts. Requires wgrad_supported(qxT, qdyT)."""
    D, Ptok = qxT.shape
    F, E = qdyT.shape[0], like.shape[0]
    dw = empty_grad_like(like, D, F)
    if like.transpose(1, 2).is_contiguous():
        out, P, sP, Q, sQ = dw.transpose(1, 2), qdyT, sdy, qxT, sx  # out[e, f, d] = sum_t dy[t, f] x[t, d]
    else:
        out, P, sP, Q, sQ = dw, qxT, sx, qdyT, sdy
    A, B = out.shape[1], out.shape[2]
    assert out.stride(2) == 1 and sP.is_contiguous() and sQ.is_contiguous()
    p_desc = TensorDescriptor(P, [A, Ptok], [Ptok, 1], [16, fq.GROUP])  # block shapes: set by the pre-hook
    q_desc = TensorDescriptor(Q, [B, Ptok], [Ptok, 1], [16, fq.GROUP])

    def grid(meta):
        return (triton.cdiv(A, meta["BA"]) * triton.cdiv(B, meta["BB"]), E)

    fp8_gg_wgrad_kernel_tma[grid](
        p_desc, q_desc, sP, sQ, out, offs_E, A, B, E, out.stride(0), out.stride(1), swap_token_tile(Ptok, E),
        BE=triton.next_power_of_2(E), PRECISION=_precision(P.dtype), G=fq.GROUP,
    )
    return dw


def supported(qx: torch.Tensor, qw: torch.Tensor) -> bool:
    """TMA can cover the operands: qx [N, K] row-major, qw [E, K, F] with memory [E, F, K] (flattens to
    [E * F, K]), 16-byte aligned bases and row strides (K % 16 == 0 in fp8)."""
    K, F = qx.shape[1], qw.shape[2]
    es = qx.element_size()
    return (qx.stride(1) == 1 and (qx.stride(0) * es) % 16 == 0 and qx.data_ptr() % 16 == 0
            and qw.stride(1) == 1 and qw.stride(2) == K and qw.stride(0) == F * K and (K * es) % 16 == 0
            and qw.data_ptr() % 16 == 0 and (INTERPRET or qx.is_cuda))


def grouped_mm(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, offs_E: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """y [N, F] from 1x128-quantised x (qx [N, K], sx [N, K/128] fp32) and 128x128-quantised w (qw [E, K, F]
    with K contiguous, sw [E, K/128, F/128] contiguous); rows >= offs[-1] zero. Requires supported(qx, qw)."""
    N, K = qx.shape
    E, _, F = qw.shape
    assert sx.stride(1) == 1 and sw.is_contiguous()
    y = torch.empty((N, F), device=qx.device, dtype=out_dtype)
    if N == 0 or F == 0:
        return y
    w2 = torch.as_strided(qw, (E * F, K), (K, 1))  # memory [E, F, K]
    w_desc = TensorDescriptor.from_tensor(w2, [16, 16])  # block shapes: set by the pre-hook
    x_desc = TensorDescriptor(qx, [N, K], [qx.stride(0), 1], [16, 16])
    max_programs = _num_programs(qx.device)  # 2 per SM
    bt_max = swap_token_tile(N, E)  # mean rows per expert as a power of two in 16..128: picks the config list

    def grid(meta):
        return (max(1, min(max_programs, (triton.cdiv(N, meta["BT"]) + E) * triton.cdiv(F, meta["BF"]))),)

    fp8_gg_fwd_kernel_tma[grid](
        x_desc, w_desc, sx, sw, y, offs_E, N, K, F, E, sx.stride(0), sw.stride(0), sw.stride(1), y.stride(0),
        bt_max, BE=triton.next_power_of_2(E), PRECISION=_precision(qx.dtype),
        BK=fq.GROUP, **({"BT": 16 if bt_max < 64 else 64} if INTERPRET else {}),
    )
    return y
