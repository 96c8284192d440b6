"""Triton grouped GEMM for small experts: forward, input gradient and weight gradient, with no host sync.

    y[rows of e]  = x[rows of e] @ w[e]          grouped_mm_fwd_kernel   (also dX = dY @ w[e]^T: a strided view)
    dW[e]         = x[rows of e]^T @ dY[rows e]  grouped_mm_wgrad_kernel (K split by the offsets)

Scheduling (forward / dX): persistent programs walk a flat list of work items (expert, n-tile, m-tile). Each
program derives the list itself from offs: it loads offs [E] into registers, counts each expert's m-tiles
(ceil(rows / BM); 0 for an empty expert), and a cumulative sum gives each expert's range of work items. A work
item finds its expert by counting the experts whose range ends at or before it. So there is no host sync, no
extra kernel, and no tile is spent on empty experts or on padding beyond one partial tile per expert. Within an
expert the m-tiles of one n-tile are consecutive, so a weight tile is reused from L2 by neighbouring programs.
Rows from offs[-1] to N are written as zeros (the same as the torch fallbacks).

Weight gradient: one program per (expert, d-tile, f-tile) tile of dW; it loops over the expert's rows in BM
chunks (an empty expert stores zeros). The output is written in the strides of w, so for the transposed view of
an [E, F, D] parameter the gradient lands contiguous in the parameter's own layout.

No atomics anywhere: every output element is written by one program with a fixed reduction order, so results
are bitwise reproducible run to run.

Loads are plain masked tl.load (rows start at arbitrary offsets, so TMA descriptors with their 16-byte alignment
rule do not fit without padding); Triton pipelines them with cp.async and issues wgmma on Hopper.

Swap-AB variant (`MOESTACK_MOE_GG_KERNEL=swap`, or variant="swap"; default "persistent" = the kernel above):
for few rows per expert (mean <= SWAP_MAX_ROWS) forward and dX compute y^T = w[e]^T x^T per (expert, f-tile,
token-tile): the weight tile [BF, BK] is the MMA's M side (wgmma wants M >= 64 per warpgroup) and the expert's
rows are its N side (BT = 16..128 from the mean rows per expert), so no MMA work or shared memory is spent on
padding rows, and weight tiles stream through deep pipelines (the GEMM is bound by reading the weights there).
Its weight gradient uses the same wgrad kernel with token chunks sized like BT.

TMA variant (`tma`, `tma-p`: gg_tma.py): the swap-AB schedule with both operands loaded through TMA tensor
descriptors, one program per work item ("tma") or persistent ("tma-p"), and a weight-gradient kernel that writes
the gradient in its contiguous order; at mean rows > SWAP_MAX_ROWS, or where the descriptors do not fit (layouts,
alignment), the kernels above run.

Legend: N rows, E experts, K reduction width (D in forward), F output width, BM/BN/BK tile sizes, BT token tile.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
import triton.testing

# TRITON_INTERPRET=1 must be set before this module is imported (the CPU tests do).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _rows_bucket(N: int, E: int) -> int:
    """Mean rows per expert, bucketed (<=32, <=128, <=512, more): the autotune key that separates small-expert
    shapes from large ones without a tuning run per batch size."""
    mean = N // max(E, 1)
    return next((b for b in (32, 128, 512) if mean <= b), 4096)


def quick_bench(kernel_call, quantiles):
    """The autotuner's timer with short windows: a few configs x many shapes must tune in seconds."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def _mm_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BM": 16, "BN": 32, "BK": 16}, num_warps=4, num_stages=1)]
    # small experts: 32/64-row tiles, deep K tiles (weight streaming); large: 128x256 (compute bound)
    shapes = [(64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (128, 256, 64, 8, 3), (32, 128, 128, 4, 4)]
    return [triton.Config({"BM": m, "BN": n, "BK": k}, num_warps=w, num_stages=s) for m, n, k, w, s in shapes]


def _wgrad_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BD": 16, "BF": 32, "BM": 16}, num_warps=4, num_stages=1)]
    shapes = [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3)]
    return [triton.Config({"BD": d, "BF": f, "BM": m}, num_warps=w, num_stages=s) for d, f, m, w, s in shapes]


KERNEL_ENV = "MOESTACK_MOE_GG_KERNEL"  # "persistent" (default), "swap", "tma", "tma-p"
VARIANTS = ("persistent", "swap", "tma", "tma-p")
SWAP_MAX_ROWS = int(os.environ.get("MOESTACK_MOE_GG_SWAP_MAX_ROWS", "128"))  # swap only at or below this mean


def _swap_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BF": 32, "BK": 16}, num_warps=4, num_stages=1)]
    # weight streaming: 128-wide weight tiles, 3-4 stages in flight; shared memory (BT 16..128): 72..128 KB and
    # 108..192 KB, so the first fits 2 programs per SM up to BT = 64 (checked: spill_report.py)
    shapes = [(128, 64, 4, 4), (128, 128, 4, 3)]
    return [triton.Config({"BF": f, "BK": k}, num_warps=w, num_stages=st) for f, k, w, st in shapes]


def _prune_swap(configs, named_args, **kwargs):
    """BT = 128 with BK = 128 spills (255 registers at 4 warps, dX layout): keep BK <= 64 there."""
    keep = [c for c in configs if kwargs.get("BT", 0) < 128 or c.kwargs["BK"] <= 64]
    return keep or configs


def _wgrad_small_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BD": 16, "BF": 32}, num_warps=4, num_stages=1)]
    # few rows per expert: the dW tile is written once after a short reduction (store bound), so wide tiles
    shapes = [(128, 128, 4, 2), (128, 256, 8, 2)]
    return [triton.Config({"BD": d, "BF": f}, num_warps=w, num_stages=st) for d, f, w, st in shapes]


def swap_token_tile(N: int, E: int) -> int:
    """The swap kernel's token tile BT: mean rows per expert rounded up to a power of two, within [16, 128]."""
    return min(128, max(16, triton.next_power_of_2(max(1, N // max(E, 1)))))


def resolve_variant(variant: str | None) -> str:
    v = variant or os.environ.get(KERNEL_ENV, "persistent")
    if v not in VARIANTS:
        raise ValueError(f"{KERNEL_ENV} / variant must be one of {VARIANTS}, got {v!r}")
    return v


@triton.jit
def _expert_tiles(offs, E, o_e, BM: tl.constexpr):
    """Per expert (vectors over o_e = arange(BE)): first row, end row, m-tiles, cumulative m-tile end."""
    m_e = o_e < E
    b_end = tl.load(offs + o_e, mask=m_e, other=0)
    b_start = tl.load(offs + o_e - 1, mask=m_e & (o_e > 0), other=0)
    b_tiles = tl.where(m_e, (tl.maximum(b_end - b_start, 0) + BM - 1) // BM, 0)
    return b_start, b_end, b_tiles, tl.cumsum(b_tiles, 0)


@triton.jit
def _pick(vec, sel):
    """The element of an int vector where sel is true (exactly one)."""
    return tl.sum(tl.where(sel, vec, 0), 0)


@triton.autotune(configs=_mm_configs(), key=["ROWS_BUCKET", "K", "F", "E"], do_bench=quick_bench)
@triton.jit(do_not_specialize=["N", "E", "ROWS_BUCKET"])
def grouped_mm_fwd_kernel(
    x, w, y, offs, N, K, F, E,
    stride_xn, stride_xk, stride_we, stride_wk, stride_wf, stride_yn, stride_yf,
    ROWS_BUCKET, BE: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    o_e = tl.arange(0, BE)
    b_start, b_end, b_tiles, b_tile_end = _expert_tiles(offs, E, o_e, BM)
    n_ntiles = tl.cdiv(F, BN)
    b_work_end = b_tile_end * n_ntiles  # [BE] cumulative work items per expert
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
        cols = i_n * BN + o_n  # [BN]
        m_cols = cols < F
        p_x = x + rows.to(tl.int64)[:, None] * stride_xn  # [BM, 1]
        p_w = w + e.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wf  # [1, BN]
        b_acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + o_k
            m_k = ks < K
            b_x = tl.load(p_x + ks[None, :] * stride_xk, mask=m_rows[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
            b_w = tl.load(p_w + ks[:, None] * stride_wk, mask=m_k[:, None] & m_cols[None, :], other=0.0)  # [BK, BN]
            b_acc = tl.dot(b_x, b_w, b_acc, input_precision=PRECISION)
        p_y = y + rows.to(tl.int64)[:, None] * stride_yn + cols[None, :] * stride_yf
        tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_rows[:, None] & m_cols[None, :])
    # rows past offs[-1]: zeros
    used = tl.load(offs + E - 1)
    tail_tiles = tl.cdiv(N - used, BM)
    for t in range(pid, tail_tiles * n_ntiles, nprog):
        rows = used + (t // n_ntiles) * BM + o_m
        cols = (t % n_ntiles) * BN + o_n
        p_y = y + rows.to(tl.int64)[:, None] * stride_yn + cols[None, :] * stride_yf
        tl.store(p_y, tl.zeros((BM, BN), dtype=y.dtype.element_ty), mask=(rows < N)[:, None] & (cols < F)[None, :])


@triton.autotune(configs=_swap_configs(), key=["ROWS_BUCKET", "K", "F", "E", "BT"], do_bench=quick_bench,
                 prune_configs_by={"early_config_prune": _prune_swap})
@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BK"] == 0})
@triton.jit(do_not_specialize=["N", "E", "ROWS_BUCKET"])
def grouped_mm_fwd_swap_kernel(
    x, w, y, offs, N, K, F, E,
    stride_xn, stride_xk, stride_we, stride_wk, stride_wf, stride_yn, stride_yf,
    ROWS_BUCKET, BE: tl.constexpr, PRECISION: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr, BK: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Swap-AB forward: acc [BF, BT] = w[e][:, f-tile]^T @ x[token-tile]^T, stored transposed into y. Same
    persistent schedule as grouped_mm_fwd_kernel with (BM, BN) -> (BT, BF)."""
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
        cols = i_f * BF + o_f  # [BF]
        m_cols = cols < F
        p_w = w + e.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wf  # [BF, 1]
        p_x = x + rows.to(tl.int64)[None, :] * stride_xn  # [1, BT]
        b_acc = tl.zeros((BF, BT), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + o_k
            if EVEN_K:
                b_w = tl.load(p_w + ks[None, :] * stride_wk, mask=m_cols[:, None], other=0.0)  # [BF, BK]
                b_x = tl.load(p_x + ks[:, None] * stride_xk, mask=m_rows[None, :], other=0.0)  # [BK, BT]
            else:
                m_k = ks < K
                b_w = tl.load(p_w + ks[None, :] * stride_wk, mask=m_cols[:, None] & m_k[None, :], other=0.0)
                b_x = tl.load(p_x + ks[:, None] * stride_xk, mask=m_k[:, None] & m_rows[None, :], other=0.0)
            b_acc = tl.dot(b_w, b_x, b_acc, input_precision=PRECISION)
        p_y = y + rows.to(tl.int64)[None, :] * stride_yn + cols[:, None] * stride_yf  # [BF, BT]
        tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_cols[:, None] & m_rows[None, :])
    used = tl.load(offs + E - 1)
    for t in range(pid, tl.cdiv(N - used, BT) * n_ftiles, nprog):
        rows = used + (t // n_ftiles) * BT + o_t
        cols = (t % n_ftiles) * BF + o_f
        p_y = y + rows.to(tl.int64)[None, :] * stride_yn + cols[:, None] * stride_yf
        tl.store(p_y, tl.zeros((BF, BT), dtype=y.dtype.element_ty), mask=(cols < F)[:, None] & (rows < N)[None, :])


@triton.autotune(configs=_wgrad_configs(), key=["ROWS_BUCKET", "D", "F", "E"], do_bench=quick_bench)
@triton.jit(do_not_specialize=["E", "ROWS_BUCKET"])
def grouped_mm_wgrad_kernel(
    x, dy, dw, offs, D, F, E,
    stride_xn, stride_xd, stride_dyn, stride_dyf, stride_we, stride_wd, stride_wf,
    ROWS_BUCKET, PRECISION: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BM: tl.constexpr,
):
    i_t, e = tl.program_id(0), tl.program_id(1)
    n_ftiles = tl.cdiv(F, BF)
    i_d, i_f = i_t // n_ftiles, i_t % n_ftiles
    start = tl.load(offs + e - 1, mask=e > 0, other=0)
    end = tl.load(offs + e)
    o_d = i_d * BD + tl.arange(0, BD)
    o_f = i_f * BF + tl.arange(0, BF)
    m_d, m_f = o_d < D, o_f < F
    b_acc = tl.zeros((BD, BF), dtype=tl.float32)
    for r0 in range(start, end, BM):
        rows = r0 + tl.arange(0, BM)
        m_r = rows < end
        rows64 = rows.to(tl.int64)
        b_xt = tl.load(x + rows64[None, :] * stride_xn + o_d[:, None] * stride_xd,
                       mask=m_d[:, None] & m_r[None, :], other=0.0)  # [BD, BM]
        b_dy = tl.load(dy + rows64[:, None] * stride_dyn + o_f[None, :] * stride_dyf,
                       mask=m_r[:, None] & m_f[None, :], other=0.0)  # [BM, BF]
        b_acc = tl.dot(b_xt, b_dy, b_acc, input_precision=PRECISION)
    p_dw = dw + e.to(tl.int64) * stride_we + o_d[:, None] * stride_wd + o_f[None, :] * stride_wf
    tl.store(p_dw, b_acc.to(dw.dtype.element_ty), mask=m_d[:, None] & m_f[None, :])


# the same wgrad kernel for few rows per expert: token chunk BM = the swap kernel's BT (host), wide dW tiles
grouped_mm_wgrad_small_kernel = triton.autotune(
    configs=_wgrad_small_configs(), key=["ROWS_BUCKET", "D", "F", "E", "BM"], do_bench=quick_bench
)(grouped_mm_wgrad_kernel.fn)


def empty_grad_like(like: torch.Tensor, D: int, F: int) -> torch.Tensor:
    """An uninitialised dW [E, D, F] in like's dtype and device, laid out as like when like is the transposed view
    of a contiguous [E, F, D] (the view Experts passes: the gradient in the parameter's layout), else contiguous."""
    E = like.shape[0]
    if like.transpose(1, 2).is_contiguous():
        return torch.empty((E, F, D), device=like.device, dtype=like.dtype).transpose(1, 2)
    return torch.empty((E, D, F), device=like.device, dtype=like.dtype)


def _precision(dtype: torch.dtype) -> str:
    """fp32 operands multiply in full fp32 (torch's default for matmul), not tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


_NUM_SMS: dict[int, int] = {}


def _num_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        # two programs per SM: where two tiles' shared memory fits, one hides the other's load latency; where
        # only one fits, the second wave takes the other half of the strided work list (same total)
        _NUM_SMS[idx] = 2 * torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def use_swap(N: int, E: int, variant: str | None) -> bool:
    """The swap-AB kernels (swap, tma, tma-p) run when chosen (variant / $MOESTACK_MOE_GG_KERNEL) and mean rows
    <= SWAP_MAX_ROWS."""
    return resolve_variant(variant) != "persistent" and N <= SWAP_MAX_ROWS * max(E, 1)


def grouped_mm_fwd(x_NK: torch.Tensor, w_EKF: torch.Tensor, offs_E: torch.Tensor,
                   variant: str | None = None) -> torch.Tensor:
    """y [N, F] = x[rows of e] @ w[e]; x, w of one dtype (any strides), offs int32 [E]. Rows >= offs[-1] zero.
    variant: "persistent" / "swap" / None (= $MOESTACK_MOE_GG_KERNEL, default persistent)."""
    N, K = x_NK.shape
    E, _, F = w_EKF.shape
    y = torch.empty((N, F), device=x_NK.device, dtype=x_NK.dtype)
    if N == 0 or F == 0:
        return y
    max_programs = _num_programs(x_NK.device)
    if use_swap(N, E, variant):
        BT = swap_token_tile(N, E)
        v = resolve_variant(variant)
        if v.startswith("tma"):
            from moestack.ops.moe import gg_tma

            if gg_tma.fwd_supported(x_NK, w_EKF):
                return gg_tma.grouped_mm_fwd(x_NK, w_EKF, offs_E, BT, persistent=v == "tma-p")

        def grid_swap(meta):
            return (max(1, min(max_programs, (triton.cdiv(N, BT) + E) * triton.cdiv(F, meta["BF"]))),)

        grouped_mm_fwd_swap_kernel[grid_swap](
            x_NK, w_EKF, y, offs_E, N, K, F, E,
            x_NK.stride(0), x_NK.stride(1), w_EKF.stride(0), w_EKF.stride(1), w_EKF.stride(2), y.stride(0),
            y.stride(1), _rows_bucket(N, E), BE=triton.next_power_of_2(E), PRECISION=_precision(x_NK.dtype), BT=BT,
        )
        return y

    def grid(meta):
        work = (triton.cdiv(N, meta["BM"]) + E) * triton.cdiv(F, meta["BN"])
        return (max(1, min(max_programs, work)),)

    grouped_mm_fwd_kernel[grid](
        x_NK, w_EKF, y, offs_E, N, K, F, E,
        x_NK.stride(0), x_NK.stride(1), w_EKF.stride(0), w_EKF.stride(1), w_EKF.stride(2), y.stride(0), y.stride(1),
        _rows_bucket(N, E), BE=triton.next_power_of_2(E), PRECISION=_precision(x_NK.dtype),
    )
    return y


def grouped_mm_wgrad(x_ND: torch.Tensor, dy_NF: torch.Tensor, offs_E: torch.Tensor, like: torch.Tensor,
                     variant: str | None = None) -> torch.Tensor:
    """dW [E, D, F] with dW[e] = x[rows of e]^T @ dy[rows of e] (zero for empty experts), in like's dtype; laid
    out as like when like is the transposed view of a contiguous [E, F, D] parameter, else contiguous."""
    N, D = x_ND.shape
    F = dy_NF.shape[1]
    E = like.shape[0]
    if use_swap(N, E, variant) and resolve_variant(variant).startswith("tma"):
        from moestack.ops.moe import gg_tma

        return gg_tma.grouped_mm_wgrad(x_ND, dy_NF, offs_E, like, swap_token_tile(N, E))
    dw = empty_grad_like(like, D, F)

    def grid(meta):
        return (triton.cdiv(D, meta["BD"]) * triton.cdiv(F, meta["BF"]), E)

    args = (x_ND, dy_NF, dw, offs_E, D, F, E,
            x_ND.stride(0), x_ND.stride(1), dy_NF.stride(0), dy_NF.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
            _rows_bucket(N, E))
    if use_swap(N, E, variant):
        grouped_mm_wgrad_small_kernel[grid](*args, PRECISION=_precision(x_ND.dtype), BM=swap_token_tile(N, E))
    else:
        grouped_mm_wgrad_kernel[grid](*args, PRECISION=_precision(x_ND.dtype))
    return dw


class TritonGroupedMM(torch.autograd.Function):
    """y = grouped x @ w with Triton forward and backward; saves x and w (no copies)."""

    @staticmethod
    def forward(ctx, x_ND, w_EDF, offs_E, variant=None):
        ctx.save_for_backward(x_ND, w_EDF, offs_E)
        ctx.variant = resolve_variant(variant)
        return grouped_mm_fwd(x_ND, w_EDF, offs_E, ctx.variant)

    @staticmethod
    def backward(ctx, dy_NF):
        x_ND, w_EDF, offs_E = ctx.saved_tensors
        dy_NF = dy_NF.to(x_ND.dtype)
        v = ctx.variant
        dx = grouped_mm_fwd(dy_NF, w_EDF.transpose(1, 2), offs_E, v) if ctx.needs_input_grad[0] else None
        dw = grouped_mm_wgrad(x_ND, dy_NF, offs_E, like=w_EDF, variant=v) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def _check(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> None:
    if x_ND.dim() != 2 or w_EDF.dim() != 3:
        raise ValueError(f"x must be [N, D] and w [E, D, F]; got x {tuple(x_ND.shape)}, w {tuple(w_EDF.shape)}")
    if x_ND.shape[1] != w_EDF.shape[1]:
        raise ValueError(f"x width {x_ND.shape[1]} != w in-dim {w_EDF.shape[1]}; pass w as [E, D, F]")
    if offs_E.dtype != torch.int32 or offs_E.shape != (w_EDF.shape[0],):
        raise ValueError(f"offs must be int32 [E={w_EDF.shape[0]}] cumulative row ends; got {offs_E.dtype} "
                         f"{tuple(offs_E.shape)}")
    if not (x_ND.device == w_EDF.device == offs_E.device):
        raise ValueError("x, w and offs must be on one device")


def grouped_mm(
    x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, variant: str | None = None
) -> torch.Tensor:
    """The "triton" backend: same contract as moestack.ops.moe.reference.grouped_mm (autocast dtype inside
    autocast, else the promoted input dtype; rows from offs[-1] on are zero). Differentiable in x and w.
    variant: kernel family (module doc), None = $MOESTACK_MOE_GG_KERNEL (default "persistent")."""
    from moestack.ops.moe.reference import _compute_dtype

    _check(x_ND, w_EDF, offs_E)
    dtype = _compute_dtype(x_ND, w_EDF)
    return TritonGroupedMM.apply(x_ND.to(dtype), w_EDF.to(dtype), offs_E.contiguous(), resolve_variant(variant))
