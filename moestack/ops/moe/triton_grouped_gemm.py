"""Triton grouped GEMM: forward, input gradient and weight gradient, with no host sync.

    y[rows of e]  = x[rows of e] @ w[e]          forward   (also dX = dY @ w[e]^T: a strided view)
    dW[e]         = x[rows of e]^T @ dY[rows e]  weight gradient, written in the parameter's own layout

At the row counts it is chosen for (the "crossover" backend: up to ~128 rows per expert) the GEMM is bound by
reading the weights once, so forward and dX run swap-AB, y^T = w[e]^T x^T per (expert, f-tile, token-tile) work
item: the weight tile [BF, BK] is the MMA's M side (wgmma wants M >= 64 per warpgroup), the expert's rows its N
side (BT = 16..128 from the mean rows per expert), so no MMA work goes to padding rows and weight tiles stream
through deep pipelines. The default kernels load both operands through TMA descriptors (gg_tma.py); where the
descriptors do not fit (layouts, alignment: an expanded gradient, an odd stride) the pointer-based kernel below
runs the same schedule. The weight gradient is gg_tma's (the Gluon kernel gluon_wgrad.py from 64 mean rows per
expert on sm_90, else the chunked Triton kernel).

Scheduling: persistent programs walk a flat list of work items (expert, f-tile, token-tile). Each program derives
the list itself from offs: it loads offs [E] into registers, counts each expert's token tiles (0 for an empty
expert), and a cumulative sum gives each expert's range of work items. A work item finds its expert by counting
the experts whose range ends at or before it. So there is no host sync, no extra kernel, and no tile is spent on
empty experts or on padding beyond one partial tile per expert. Rows from offs[-1] to N are written as zeros (the
same as the torch fallbacks). No atomics anywhere: every output element is written by one program with a fixed
reduction order, so results are bitwise reproducible run to run.

(The non-swapped persistent kernel, its weight-gradient kernels and the swap / tma-p families lost to torch or to
the TMA kernels at every shape the crossover sends here and were removed: README.md.)

Legend: N rows, E experts, K reduction width (D in forward), F output width, BT token tile, BF/BK weight tile.
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


def _swap_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BF": 32, "BK": 16}, num_warps=4, num_stages=1)]
    # weight streaming: 128-wide weight tiles, 3-4 stages in flight; shared memory (BT 16..128): 72..128 KB and
    # 108..192 KB, so the first fits 2 programs per SM up to BT = 64 (benchmarks/tools/launch_fit_check.py moe)
    shapes = [(128, 64, 4, 4), (128, 128, 4, 3)]
    return [triton.Config({"BF": f, "BK": k}, num_warps=w, num_stages=st) for f, k, w, st in shapes]


def _prune_swap(configs, named_args, **kwargs):
    """BT = 128 with BK = 128 spills (255 registers at 4 warps, dX layout): keep BK <= 64 there; then what fits."""
    from moestack.ops.launch import fit_configs

    args = {**named_args, **kwargs}
    keep = [c for c in configs if args.get("BT", 0) < 128 or c.kwargs["BK"] <= 64] or configs
    return fit_configs(keep, args, "gg_swap")


def swap_token_tile(N: int, E: int) -> int:
    """The swap kernel's token tile BT: mean rows per expert rounded up to a power of two, within [16, 128]."""
    return min(128, max(16, triton.next_power_of_2(max(1, N // max(E, 1)))))


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
    """Swap-AB forward with pointer loads: acc [BF, BT] = w[e][:, f-tile]^T @ x[token-tile]^T, stored transposed
    into y (the module doc's schedule)."""
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


def grouped_mm_fwd(x_NK: torch.Tensor, w_EKF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """y [N, F] = x[rows of e] @ w[e]; x, w of one dtype (any strides), offs int32 [E]. Rows >= offs[-1] zero."""
    from moestack.ops.moe import gg_tma

    N, K = x_NK.shape
    E, _, F = w_EKF.shape
    BT = swap_token_tile(N, E)
    if gg_tma.fwd_supported(x_NK, w_EKF):
        return gg_tma.grouped_mm_fwd(x_NK, w_EKF, offs_E, BT)
    y = torch.empty((N, F), device=x_NK.device, dtype=x_NK.dtype)
    if N == 0 or F == 0:
        return y
    max_programs = _num_programs(x_NK.device)

    def grid(meta):
        return (max(1, min(max_programs, (triton.cdiv(N, BT) + E) * triton.cdiv(F, meta["BF"]))),)

    grouped_mm_fwd_swap_kernel[grid](
        x_NK, w_EKF, y, offs_E, N, K, F, E,
        x_NK.stride(0), x_NK.stride(1), w_EKF.stride(0), w_EKF.stride(1), w_EKF.stride(2), y.stride(0),
        y.stride(1), _rows_bucket(N, E), BE=triton.next_power_of_2(E), PRECISION=_precision(x_NK.dtype), BT=BT,
    )
    return y


def grouped_mm_wgrad(x_ND: torch.Tensor, dy_NF: torch.Tensor, offs_E: torch.Tensor, like: torch.Tensor
                     ) -> torch.Tensor:
    """dW [E, D, F] with dW[e] = x[rows of e]^T @ dy[rows of e] (zero for empty experts), in like's dtype; laid
    out as like when like is the transposed view of a contiguous [E, F, D] parameter, else contiguous."""
    from moestack.ops.moe import gg_tma

    return gg_tma.grouped_mm_wgrad(x_ND, dy_NF, offs_E, like, swap_token_tile(x_ND.shape[0], like.shape[0]))


class TritonGroupedMM(torch.autograd.Function):
    """y = grouped x @ w with Triton forward and backward; saves x and w (no copies)."""

    @staticmethod
    def forward(ctx, x_ND, w_EDF, offs_E):
        ctx.save_for_backward(x_ND, w_EDF, offs_E)
        return grouped_mm_fwd(x_ND, w_EDF, offs_E)

    @staticmethod
    def backward(ctx, dy_NF):
        x_ND, w_EDF, offs_E = ctx.saved_tensors
        dy_NF = dy_NF.to(x_ND.dtype)
        dx = grouped_mm_fwd(dy_NF, w_EDF.transpose(1, 2), offs_E) if ctx.needs_input_grad[0] else None
        dw = grouped_mm_wgrad(x_ND, dy_NF, offs_E, like=w_EDF) if ctx.needs_input_grad[1] else None
        return dx, dw, None


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


def grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """The "triton" backend: same contract as moestack.ops.moe.reference.grouped_mm (autocast dtype inside
    autocast, else the promoted input dtype; rows from offs[-1] on are zero). Differentiable in x and w."""
    from moestack.ops.moe.reference import _compute_dtype

    _check(x_ND, w_EDF, offs_E)
    dtype = _compute_dtype(x_ND, w_EDF)
    return TritonGroupedMM.apply(x_ND.to(dtype), w_EDF.to(dtype), offs_E.contiguous())
