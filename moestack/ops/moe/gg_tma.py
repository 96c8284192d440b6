"""Grouped GEMM for few rows per expert with TMA tensor descriptors: the default Triton grouped GEMM's kernels.

    y[rows of e]  = x[rows of e] @ w[e]           gg_fwd_kernel_tma    (dX = dY @ w[e]^T: the same kernel, W_KMAJOR=0)
    dW[e]         = x[rows of e]^T @ dY[rows e]   gg_wgrad_kernel_tma  (written in the parameter's own layout)

At a few rows per expert the GEMM is bound by reading the weights once (K3 EP16: 3.7 GB per layer forward). So:

- Swap-AB (as triton_grouped_gemm's pointer kernel): acc [BF, BT] = w[e]^T-tile [BF, BK] @ x-tile^T [BK, BT]; the weight
  columns are the MMA's M side (wgmma wants M >= 64), the expert's rows (BT = 16..128) its N side.
- Both operands come in by TMA (host `TensorDescriptor`s, block shapes set per autotune config by a pre-hook), so
  the weight stream costs no address arithmetic or masks in registers and the loads of a stage are one bulk copy.
  The weight is a 2D view [E * R, C] of the parameter (R, C = F, K when K is contiguous: the forward with Experts'
  transposed [E, F, D] parameter; R, C = K, F when F is contiguous: dX). A tile can run past its expert:
  * F side (forward, F % BF != 0): the extra weight rows belong to expert e + 1 and land only in output columns
    >= F, which the store masks;
  * K side (dX): the host requires K % BK == 0 there, so a K tile never leaves its expert;
  * x rows past the expert's end belong to the next expert and land only in masked output columns of acc; rows
    and columns past the tensor's end are zero-filled by TMA.
  Row starts need no alignment (TMA box coordinates are arbitrary; only base address and strides are 16-byte).
- Schedule: the work list (expert, f-tile, token-tile) of triton_grouped_gemm, derived in registers from offs (no
  host sync, no tile on empty experts); token tiles of one weight tile are consecutive (L2 reuse under skew).
  Grid: one program per work item (upper bound cdiv(N, BT) + E token tiles; extra programs exit at once), so the
  hardware overlaps one program's pipeline fill / epilogue with another's stream.
- Weight gradient, few rows: out[e, a, b] = sum_r P[r, a] Q[r, b] with b the contiguous dimension of the gradient
  (P, Q = dY, X for the [E, F, D] parameter layout, X, dY for a contiguous [E, D, F]), so the accumulator's rows
  are stored coalesced; one program per (expert, a-tile, group of GB b-tiles), one flat loop over (b-tile, row
  chunk of BT) pipelined 3 deep, so operand chunks stream across tile boundaries and the next tile's loads
  overlap this tile's store (a loop per tile would wait for its first load after every store). Row chunks are
  masked loads (rows past the expert must not contribute); plain masked stores (116-128 registers at 8 warps: two
  programs per SM).
- Weight gradient from 64 mean rows per expert on sm_90: gluon_wgrad.py (experts of at most its RMAX rows), the
  larger experts by gg_wgrad_kernel_large here (chunks of RMAX rows per b-tile).

No atomics: each output element is written by one program in a fixed order (bitwise reproducible).
Legend: N rows, E experts, K reduction width, F output width, BT token tile, BF/BK weight tile, BA/BB dW tile.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moestack.ops.launch import pruner
from moestack.ops.moe.triton_grouped_gemm import (
    INTERPRET,
    _expert_tiles,
    _pick,
    _precision,
    empty_grad_like,
    quick_bench,
)

_MIN_BK = 16 if INTERPRET else 64  # smallest K tile of the configs (dX needs K % BK == 0)


# (BT, BF, BK, warps, stages) tried per BT_MAX (the mean rows per expert rounded up to a power of two, 16..128).
# Shared memory per program = stages * (BF + BT) * BK * 2 B: at BT = 16, 72 KB (3 programs per SM), 108 KB (2),
# 144 KB (1); at BT = 128, 3 stages of 128 x 64 tiles (96 KB) let two programs share an SM (one's pipeline fill
# and epilogue hide behind the other's stream), 4 stages (128 KB) one. Every program also reads its x tile
# [BT, K] (from L2, once per f-tile), so the SMs take in (1 + BT / BF) x the weight bytes: BF = 256 halves the
# extra at BT = 64..128, where L2 -> SM traffic may bind before DRAM does.
# A BT below BT_MAX reads a weight tile once per token tile (the repeats from L2) but fits more programs per SM;
# such entries reuse binaries compiled for the smaller BT_MAX (no extra compile when those sizes ran first).
FWD_CONFIGS = {
    16: [(16, 128, 64, 4, 4), (16, 128, 128, 4, 4), (16, 128, 128, 4, 3)],
    32: [(32, 128, 64, 4, 4), (32, 128, 128, 4, 4), (16, 128, 64, 4, 4), (16, 128, 128, 4, 3)],
    64: [(64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (64, 256, 64, 8, 3), (32, 128, 64, 4, 4)],
    128: [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
          (64, 128, 64, 4, 4)],
}


def _fwd_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BT": 16, "BF": 32, "BK": 16}, num_warps=4, num_stages=1, pre_hook=_fwd_blocks)]
    shapes = sorted({c for cs in FWD_CONFIGS.values() for c in cs})
    return [triton.Config({"BT": t, "BF": f, "BK": k}, num_warps=w, num_stages=s, pre_hook=_fwd_blocks)
            for t, f, k, w, s in shapes]


def _fwd_blocks(nargs) -> None:
    """Autotune pre-hook: the descriptors' block shapes follow the config."""
    BT, BF, BK = nargs["BT"], nargs["BF"], nargs["BK"]
    nargs["x_desc"].block_shape = [BT, BK]
    nargs["w_desc"].block_shape = [BF, BK] if nargs["W_KMAJOR"] else [BK, BF]


def _prune_fwd(configs, named_args, **kwargs):
    """The configs listed for this BT_MAX; on the dX layout only BK dividing K (tiles stay inside an expert)."""
    args = {**named_args, **kwargs}
    want = FWD_CONFIGS[args["BT_MAX"]]
    keep = [c for c in configs
            if (c.kwargs["BT"], c.kwargs["BF"], c.kwargs["BK"], c.num_warps, c.num_stages) in want
            and (args["W_KMAJOR"] or args["K"] % c.kwargs["BK"] == 0)]
    from moestack.ops.launch import fit_configs

    return fit_configs(keep or configs[:1], args, "gg_tma_fwd")


@triton.autotune(configs=_fwd_configs(), key=["K", "F", "E", "BT_MAX", "W_KMAJOR"], do_bench=quick_bench,
                 prune_configs_by={"early_config_prune": _prune_fwd})
@triton.jit(do_not_specialize=["N", "E", "BT_MAX"])
def gg_fwd_kernel_tma(
    x_desc, w_desc, y, offs, N, K, F, E, stride_yn, stride_yf, BT_MAX,
    BE: tl.constexpr, PRECISION: tl.constexpr, W_KMAJOR: tl.constexpr,
    BT: tl.constexpr, BF: tl.constexpr, BK: tl.constexpr,
):
    """acc [BF, BT] = w[e][:, f-tile]^T @ x[token-tile]^T per work item, stored transposed into y [N, F]."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    o_e = tl.arange(0, BE)
    b_start, b_end, b_tiles, b_tile_end = _expert_tiles(offs, E, o_e, BT)
    n_ftiles = tl.cdiv(F, BF)
    b_work_end = b_tile_end * n_ftiles  # [BE] cumulative work items per expert
    total = tl.sum(b_tiles, 0) * n_ftiles
    o_t, o_f = tl.arange(0, BT), tl.arange(0, BF)
    for t in range(pid, total, nprog):
        e = tl.sum((b_work_end <= t).to(tl.int32), 0)
        sel = o_e == e
        tiles_e = _pick(b_tiles, sel)
        local = t - (_pick(b_work_end, sel) - tiles_e * n_ftiles)
        i_f, i_t = local // tiles_e, local % tiles_e
        row0 = _pick(b_start, sel) + i_t * BT
        f0 = i_f * BF
        b_acc = tl.zeros((BF, BT), dtype=tl.float32)
        for k0 in range(0, K, BK):
            b_x = x_desc.load([row0, k0])  # [BT, BK]
            if W_KMAJOR:
                b_w = w_desc.load([e * F + f0, k0])  # [BF, BK]
            else:
                b_w = tl.trans(w_desc.load([e * K + k0, f0]))  # [BK, BF] -> [BF, BK]
            b_acc = tl.dot(b_w, tl.trans(b_x), b_acc, input_precision=PRECISION)
        rows = row0 + o_t  # [BT]
        cols = f0 + o_f  # [BF]
        p_y = y + rows.to(tl.int64)[None, :] * stride_yn + cols[:, None] * stride_yf  # [BF, BT]
        tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=(cols < F)[:, None] & (rows < _pick(b_end, sel))[None, :])
    # rows past offs[-1]: zeros
    used = tl.load(offs + E - 1)
    for t in range(pid, tl.cdiv(N - used, BT) * n_ftiles, nprog):
        rows = used + (t // n_ftiles) * BT + o_t
        cols = (t % n_ftiles) * BF + o_f
        p_y = y + rows.to(tl.int64)[None, :] * stride_yn + cols[:, None] * stride_yf
        tl.store(p_y, tl.zeros((BF, BT), dtype=y.dtype.element_ty), mask=(cols < F)[:, None] & (rows < N)[None, :])


def _wgrad_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BA": 16, "BB": 32, "GB": 2}, num_warps=4, num_stages=1)]
    # few rows: each dW tile is written once after a short reduction (store bound); GB tiles per program, the
    # flat loop pipelined 3 deep. (BA, BB, GB, warps, stages): 64 accumulator registers per thread, 116-128 in
    # all, so two programs per SM at 8 warps, three at 4 (benchmarks/tools/launch_fit_check.py moe --hints --ptxas)
    shapes = [(128, 128, 8, 8, 3), (64, 128, 8, 4, 3)]
    return [triton.Config({"BA": a, "BB": b, "GB": g}, num_warps=w, num_stages=s) for a, b, g, w, s in shapes]


_prune_wgrad = pruner("gg_wgrad")


@triton.autotune(configs=_wgrad_configs(), key=["A", "B", "E", "BT"], do_bench=quick_bench,
                 prune_configs_by={"early_config_prune": _prune_wgrad})
@triton.jit(do_not_specialize=["E"])
def gg_wgrad_kernel_tma(
    p, q, out, offs, A, B, E, stride_pn, stride_pa, stride_qn, stride_qb, stride_oe, stride_oa, stride_ob,
    PRECISION: tl.constexpr, BT: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, GB: tl.constexpr,
):
    """out[e, a-tile, b-tiles] = P[rows of e, a-tile]^T @ Q[rows of e, b-tile] for GB consecutive b-tiles, as one
    flat loop over (b-tile, row chunk of BT) so the software pipeline streams operand chunks across tile
    boundaries (the next tile's loads overlap this tile's store). An empty expert still runs one (all-masked)
    chunk per tile, which stores its zeros."""
    i_t, e = tl.program_id(0), tl.program_id(1)
    n_groups = tl.cdiv(tl.cdiv(B, BB), GB)
    i_a, i_g = i_t // n_groups, i_t % n_groups
    start = tl.load(offs + e - 1, mask=e > 0, other=0)
    end = tl.load(offs + e)
    n_chunks = tl.maximum(tl.cdiv(end - start, BT), 1)
    o_a = i_a * BA + tl.arange(0, BA)
    m_a = o_a < A
    p_oe = out + e.to(tl.int64) * stride_oe
    b_acc = tl.zeros((BA, BB), dtype=tl.float32)
    for it in range(GB * n_chunks):
        j, c = it // n_chunks, it % n_chunks
        b0 = (i_g * GB + j) * BB
        o_b = b0 + tl.arange(0, BB)
        m_b = o_b < B
        rows = start + c * BT + tl.arange(0, BT)
        m_r = rows < end
        rows64 = rows.to(tl.int64)
        b_p = tl.load(p + rows64[:, None] * stride_pn + o_a[None, :] * stride_pa,
                      mask=m_r[:, None] & m_a[None, :], other=0.0)  # [BT, BA]
        b_q = tl.load(q + rows64[:, None] * stride_qn + o_b[None, :] * stride_qb,
                      mask=m_r[:, None] & m_b[None, :], other=0.0)  # [BT, BB]
        b_acc = tl.dot(tl.trans(b_p), b_q, b_acc, input_precision=PRECISION)
        if c == n_chunks - 1:
            tl.store(p_oe + o_a[:, None] * stride_oa + o_b[None, :] * stride_ob, b_acc.to(out.dtype.element_ty),
                     mask=m_a[:, None] & m_b[None, :])
            b_acc = tl.zeros((BA, BB), dtype=tl.float32)


# The weight gradient: gluon_wgrad from GLUON_MIN_ROWS mean rows per expert where it applies (H200, K3 EP16: faster
# than the chunked kernel and torch at 64 rows, slower than chunked at 32), with gg_wgrad_kernel_large for the
# experts above its RMAX rows; else gg_wgrad_kernel_tma.
GLUON_MIN_ROWS = 64


@triton.autotune(configs=_wgrad_configs(), key=["A", "B", "E", "RMAX"], do_bench=quick_bench,
                 prune_configs_by={"early_config_prune": _prune_wgrad})
@triton.jit(do_not_specialize=["E"])
def gg_wgrad_kernel_large(
    p, q, out, offs, A, B, E, stride_pn, stride_pa, stride_qn, stride_qb, stride_oe, stride_oa, stride_ob,
    PRECISION: tl.constexpr, RMAX: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, GB: tl.constexpr,
    SKIP_ROWS: tl.constexpr,
):
    """gg_wgrad_kernel_tma's output (same grid) for the experts of more than SKIP_ROWS rows (the others are
    gluon_wgrad's): per b-tile, the expert's rows in chunks of RMAX."""
    i_t, e = tl.program_id(0), tl.program_id(1)
    n_groups = tl.cdiv(tl.cdiv(B, BB), GB)
    i_a, i_g = i_t // n_groups, i_t % n_groups
    start = tl.load(offs + e - 1, mask=e > 0, other=0)
    end = tl.load(offs + e)
    o_a = i_a * BA + tl.arange(0, BA)
    m_a = o_a < A
    p_oe = out + e.to(tl.int64) * stride_oe
    if end - start <= SKIP_ROWS:
        return
    o_r = tl.arange(0, RMAX)
    for j in range(GB):
        o_b = (i_g * GB + j) * BB + tl.arange(0, BB)
        m_b = o_b < B
        b_acc = tl.zeros((BA, BB), dtype=tl.float32)
        for r0 in range(start, end, RMAX):
            rows64 = (r0 + o_r).to(tl.int64)
            m_r = r0 + o_r < end
            b_p = tl.load(p + rows64[:, None] * stride_pn + o_a[None, :] * stride_pa,
                          mask=m_r[:, None] & m_a[None, :], other=0.0)  # [RMAX, BA]
            b_q = tl.load(q + rows64[:, None] * stride_qn + o_b[None, :] * stride_qb,
                          mask=m_r[:, None] & m_b[None, :], other=0.0)  # [RMAX, BB]
            b_acc = tl.dot(tl.trans(b_p), b_q, b_acc, input_precision=PRECISION)
        tl.store(p_oe + o_a[:, None] * stride_oa + o_b[None, :] * stride_ob, b_acc.to(out.dtype.element_ty),
                 mask=m_a[:, None] & m_b[None, :])


def _tma_ok(t: torch.Tensor) -> bool:
    """A tensor a TMA descriptor can cover: unit last stride, 16-byte base, positive 16-byte outer strides (an
    expanded gradient, stride 0, goes to the pointer-based swap kernel)."""
    es = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s > 0 and (s * es) % 16 == 0 for s in t.stride()[:-1])


def fwd_supported(x_NK: torch.Tensor, w_EKF: torch.Tensor) -> bool:
    """Whether gg_fwd_kernel_tma takes these operands (else the caller runs the pointer-based swap kernel)."""
    K, F = x_NK.shape[1], w_EKF.shape[2]
    on_device = INTERPRET or (x_NK.is_cuda and x_NK.dtype in (torch.bfloat16, torch.float16))
    if K == 0 or not on_device or not _tma_ok(x_NK):
        return False
    if w_EKF.stride(1) == 1:  # memory [E, F, K]: must flatten to [E * F, K]
        return w_EKF.stride(0) == F * w_EKF.stride(2) and _tma_ok(w_EKF.transpose(1, 2))
    # memory [E, K, F]: flattens to [E * K, F]; K tiles must stay inside an expert
    return w_EKF.stride(2) == 1 and w_EKF.stride(0) == K * w_EKF.stride(1) and K % _MIN_BK == 0 and _tma_ok(w_EKF)


def grouped_mm_fwd(x_NK: torch.Tensor, w_EKF: torch.Tensor, offs_E: torch.Tensor, BT_MAX: int) -> torch.Tensor:
    """y [N, F] = x[rows of e] @ w[e] (rows >= offs[-1] zero); requires fwd_supported(x, w). BT_MAX: the mean
    rows per expert as a power of two in 16..128 (triton_grouped_gemm.swap_token_tile), picks the configs."""
    N, K = x_NK.shape
    E, _, F = w_EKF.shape
    y = torch.empty((N, F), device=x_NK.device, dtype=x_NK.dtype)
    if N == 0 or F == 0:
        return y
    kmajor = w_EKF.stride(1) == 1
    if kmajor:  # memory [E, F, K] -> [E * F, K]
        w2 = torch.as_strided(w_EKF, (E * F, K), (w_EKF.stride(2), 1))
    else:  # memory [E, K, F] -> [E * K, F]
        w2 = torch.as_strided(w_EKF, (E * K, F), (w_EKF.stride(1), 1))
    w_desc = TensorDescriptor.from_tensor(w2, [16, 16])
    x_desc = TensorDescriptor(x_NK, [N, K], [x_NK.stride(0), 1], [16, 16])  # block shapes: set by the pre-hook
    def grid(meta):
        return (max(1, (triton.cdiv(N, meta["BT"]) + E) * triton.cdiv(F, meta["BF"])),)

    gg_fwd_kernel_tma[grid](
        x_desc, w_desc, y, offs_E, N, K, F, E, y.stride(0), y.stride(1), BT_MAX,
        BE=triton.next_power_of_2(E), PRECISION=_precision(x_NK.dtype), W_KMAJOR=kmajor,
    )
    return y


@functools.cache
def _gluon_wgrad():
    """The gluon_wgrad module, imported on first use; None on a Triton without Gluon's Hopper API."""
    try:
        from moestack.ops.moe import gluon_wgrad
    except ImportError:
        return None
    return gluon_wgrad


def _gluon_wgrad_ok(P: torch.Tensor, Q: torch.Tensor, out: torch.Tensor) -> bool:
    """gluon_wgrad covers these operands (sm_90, Triton with Gluon; else the Triton kernels run)."""
    module = _gluon_wgrad()
    return module is not None and module.supported(P, Q, out)


def grouped_mm_wgrad(x_ND: torch.Tensor, dy_NF: torch.Tensor, offs_E: torch.Tensor, like: torch.Tensor,
                     BT_MAX: int, gluon: bool | None = None) -> torch.Tensor:
    """dW [E, D, F], dW[e] = x[rows of e]^T @ dy[rows of e] (zero for empty experts), in like's dtype and layout
    (the transposed view of [E, F, D] when like is one, else contiguous [E, D, F]). gluon (None: from
    GLUON_MIN_ROWS mean rows per expert) runs gluon_wgrad where it applies (experts of <= 2 BT_MAX rows, <= 256;
    the larger ones by gg_wgrad_kernel_large); else gg_wgrad_kernel_tma, rows in chunks of min(BT_MAX, 64)."""
    D = x_ND.shape[1]
    F = dy_NF.shape[1]
    E = like.shape[0]
    dw = empty_grad_like(like, D, F)
    if like.transpose(1, 2).is_contiguous():
        out, P, Q = dw.transpose(1, 2), dy_NF, x_ND  # out[e, f, d] = sum_r dy[r, f] x[r, d]
    else:
        out, P, Q = dw, x_ND, dy_NF
    A, B = out.shape[1], out.shape[2]

    def grid(meta):
        return (triton.cdiv(A, meta["BA"]) * triton.cdiv(triton.cdiv(B, meta["BB"]), meta["GB"]), E)

    gluon = (BT_MAX >= GLUON_MIN_ROWS) if gluon is None else gluon
    if gluon and not INTERPRET and _gluon_wgrad_ok(P, Q, out):
        skip = _gluon_wgrad().rmax_for(BT_MAX)
        _gluon_wgrad().wgrad_gluon(P, Q, out, offs_E, skip)
        gg_wgrad_kernel_large[grid](
            P, Q, out, offs_E, A, B, E, P.stride(0), P.stride(1), Q.stride(0), Q.stride(1),
            out.stride(0), out.stride(1), out.stride(2), PRECISION=_precision(x_ND.dtype),
            RMAX=min(128, max(32, 2 * BT_MAX)), SKIP_ROWS=skip,
        )  # fmt: skip
        return dw
    gg_wgrad_kernel_tma[grid](
        P, Q, out, offs_E, A, B, E, P.stride(0), P.stride(1), Q.stride(0), Q.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        PRECISION=_precision(x_ND.dtype), BT=min(BT_MAX, 16 if INTERPRET else 64),
    )
    return dw
