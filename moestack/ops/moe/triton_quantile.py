"""Fused Triton solver of batch-scope quantile balancing: the same coordinate steps as
quantile.batch_bias_reference (the spec, and the module docstring of quantile.py), in 2 launches per step
instead of ~200 small aten ops.

Per coordinate step:
    required   one program per BT tokens (all E experts, padded to BE): choice = s + b, its top-(K+1) values
               (K+1 rounds of "remove one largest"; values, not indices, enter r, so ties among equal choices do
               not matter), r_tj = (K+1-th value if choice_tj >= the K-th, else the K-th) - s_tj, written
               expert-major r_ET; the per-expert min r and min -r go to ends_2E by fp32 atomic min (exact in any
               order). Steps after the first centre the previous step's bias first (b - mean b); with
               momentum > 0 one single-program launch before it centres and extrapolates (quantile.extrapolate).
    solve      one program per expert: the bin of r_e. in B bins of [min, max] where the cumulative count reaches
               the target, the same in B bins of that bin, the quantile read with interpolation. Each program
               owns its expert's row, so counts are register histograms (tl.histogram), no atomics.
With a balance group of > 1 ranks the solve runs as three launches (coarse counts, fine counts, read) with the
counts and the ends all-reduced between them exactly where the reference reduces them; one rank runs it fused.

The fused solve never forms the B-bin histograms: it finds each level's bin as a two-digit radix select, bin =
hi * NL + lo with NL = 32, one pass counting the high digit (B / 32 bins), one counting the low digit of the
tokens under the high digit that reaches the target. Why: tl.histogram costs each element a ballot per index bit
plus a popcount per bin its lane owns (bins / 32) and each chunk bins / 32 shared-memory atomics per thread, so
1024 bins cost over 10x what 32 do; four cheap passes over a row (L2-resident at T = 8192) beat two dear ones. The
bin, the count up to it and the count in it are integers equal to those of the full histogram, so the result is
the staged solve's bit for bit (tests/ops/test_moe_quantile_triton.py).

Bitwise agreement with the reference: r, the bin index ((r - lo) / width, floor, clamp), the ranges and the
interpolation use the reference's fp32 / fp64 operations in its order (IEEE division, FMA contraction off), so
the counts are identical. Two reference details are copied on purpose: torch on CUDA divides by a CPU scalar as a
multiply by its fp32 reciprocal (`width / B` in the fine range), on CPU it divides. What differs is the order of
the fp32 sum in each step's mean-centring (the mean may differ by its last bits).

Legend: T tokens, E experts (BE padded), K top-k, B bins (BB padded).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
STAGE_FUSED, STAGE_COARSE, STAGE_FINE, STAGE_READ = 0, 1, 2, 3
BLOCK_T_SOLVE = 1024  # tokens per chunk of a staged solve program's B-bin passes over its expert's row
# tokens per chunk of the fused solve's digit passes: 8 per thread, ~48 registers (sm_90), so ~5 programs per SM
# hide the row's loads; 4096 issues ~20% fewer instructions per token but fits 2 programs (~103 registers)
BLOCK_T_SELECT = 2048
DIGIT_BINS = 32  # the low digit of the radix select: one bin per lane, tl.histogram's cheapest size


def _block_tokens(BE: int) -> int:
    """Tokens per `required` program: a [BT, BE] fp32 tile of ~4K elements."""
    return max(1, min(16, 4096 // BE))


@triton.jit(do_not_specialize=["T"])
def quantile_fwd_kernel_required(
    s_ptr, b_ptr, r_ptr, ends_ptr, T, E,
    K: tl.constexpr, CENTER: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_e = tl.arange(0, BE)
    m_t, m_e = o_t < T, o_e < E
    m_te = m_t[:, None] & m_e[None, :]
    b_b = tl.load(b_ptr + o_e, mask=m_e, other=0.0)  # [BE]
    if CENTER:  # the previous step's solve, centred (every program sums in the same order)
        b_b = b_b - tl.math.div_rn(tl.sum(b_b, axis=0), E.to(tl.float32))
    p_te = o_t.to(tl.int64)[:, None] * E + o_e[None, :]
    b_s = tl.load(s_ptr + p_te, mask=m_te, other=0.0)  # [BT, BE]
    b_c = tl.where(m_e[None, :], b_s + b_b[None, :], float("-inf"))
    b_work = b_c
    b_vk = tl.zeros([BT], dtype=tl.float32)
    b_vk1 = tl.zeros([BT], dtype=tl.float32)
    for i in tl.static_range(K + 1):
        b_m = tl.max(b_work, axis=1)  # [BT]: the (i+1)-th largest choice
        if i == K - 1:
            b_vk = b_m
        if i == K:
            b_vk1 = b_m
        else:  # remove one lane holding it (the lowest index; any one would do)
            b_i = tl.min(tl.where(b_work == b_m[:, None], o_e[None, :], BE), axis=1)
            b_work = tl.where(o_e[None, :] == b_i[:, None], float("-inf"), b_work)
    b_r = tl.where(b_c >= b_vk[:, None], b_vk1[:, None], b_vk[:, None]) - b_s  # [BT, BE]
    p_et = o_e.to(tl.int64)[None, :] * T + o_t[:, None]
    tl.store(r_ptr + p_et, b_r, mask=m_te)
    b_lo = tl.min(tl.where(m_te, b_r, float("inf")), axis=0)  # [BE]
    b_nhi = tl.min(tl.where(m_te, -b_r, float("inf")), axis=0)
    tl.atomic_min(ends_ptr + o_e, b_lo, mask=m_e)
    tl.atomic_min(ends_ptr + E + o_e, b_nhi, mask=m_e)


@triton.jit
def _bin_index(b_r, lo, width, B):
    """int32 bins of r in B bins from lo of `width`, the edges clamped: quantile._add_counts_'s bin index."""
    b_x = tl.floor(tl.math.div_rn(b_r - lo, width))
    return tl.minimum(tl.maximum(b_x, 0.0), (B - 1).to(tl.float32)).to(tl.int32)


@triton.jit
def _row_counts(r_ptr, T, lo, width, B, BB: tl.constexpr, BLOCK_T: tl.constexpr):
    """int32 [BB]: counts of one expert's r (r_ptr: its row of T) in B bins (_bin_index)."""
    o_t = tl.arange(0, BLOCK_T)
    b_h = tl.zeros([BB], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        m_t = t0 + o_t < T
        b_r = tl.load(r_ptr + t0 + o_t, mask=m_t, other=0.0)  # [BLOCK_T]
        b_h += tl.histogram(_bin_index(b_r, lo, width, B), BB, mask=m_t)
    return b_h


@triton.jit
def _first_reaching(b_h, target, B, BB: tl.constexpr):
    """(bin, cumulative count up to it, count in it): the first of B bins whose cumulative count reaches the
    target (the last bin at most)."""
    o_b = tl.arange(0, BB)
    b_cum = tl.cumsum(b_h, axis=0)
    at = tl.sum(((o_b < B) & (b_cum.to(tl.float64) < target)).to(tl.int32), axis=0)
    at = tl.minimum(at, B - 1)
    upto = tl.sum(tl.where(o_b == at, b_cum, 0), axis=0)
    within = tl.sum(tl.where(o_b == at, b_h, 0), axis=0)
    return at, upto, within


@triton.jit
def _row_select(r_ptr, T, lo, width, target, B, NH: tl.constexpr, NL: tl.constexpr, BLOCK_T: tl.constexpr):
    """_first_reaching of _row_counts(r_ptr, T, lo, width, B) without the B-bin counts: a radix select on
    bin = hi * NL + lo, a pass counting hi (NH bins; skipped for NH = 1), then one counting lo of the tokens whose hi
    is the first to reach the target (the last at most). Integer counts, so the same three values."""
    o_t = tl.arange(0, BLOCK_T)
    if NH > 1:
        b_hh = tl.zeros([NH], dtype=tl.int32)
        for t0 in range(0, T, BLOCK_T):
            m_t = t0 + o_t < T
            b_r = tl.load(r_ptr + t0 + o_t, mask=m_t, other=0.0)  # [BLOCK_T]
            b_hh += tl.histogram(_bin_index(b_r, lo, width, B) // NL, NH, mask=m_t)
        b_cum = tl.cumsum(b_hh, axis=0)
        hi = tl.sum((b_cum.to(tl.float64) < target).to(tl.int32), axis=0)
        hi = tl.minimum(hi, (B - 1) // NL)  # none reaches it (the target above the count): the last bin's digit
        below = tl.sum(tl.where(tl.arange(0, NH) < hi, b_hh, 0), axis=0)  # the tokens in bins < hi * NL
    else:
        hi = 0
        below = 0
    b_hl = tl.zeros([NL], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        m_t = t0 + o_t < T
        b_r = tl.load(r_ptr + t0 + o_t, mask=m_t, other=0.0)
        b_x = _bin_index(b_r, lo, width, B)
        b_hl += tl.histogram(b_x % NL, NL, mask=m_t & (b_x // NL == hi))
    o_l = tl.arange(0, NL)
    b_cum = below + tl.cumsum(b_hl, axis=0)  # the B-bin cumulative counts of bins hi * NL + o_l
    at = tl.minimum(hi * NL + tl.sum((b_cum.to(tl.float64) < target).to(tl.int32), axis=0), B - 1)
    upto = tl.sum(tl.where(o_l == at - hi * NL, b_cum, 0), axis=0)
    within = tl.sum(tl.where(o_l == at - hi * NL, b_hl, 0), axis=0)
    return at, upto, within


@triton.jit(do_not_specialize=["T"])
def quantile_fwd_kernel_solve(
    r_ptr, ends_ptr, n_ptr, hc_ptr, hf_ptr, range_ptr, b_ptr, T, E, B, scale,
    K: tl.constexpr, STAGE: tl.constexpr, HAS_N: tl.constexpr, RECIP_DIV: tl.constexpr,
    BB: tl.constexpr, NH: tl.constexpr, NL: tl.constexpr, BLOCK_T: tl.constexpr,
):
    e = tl.program_id(0)
    o_b = tl.arange(0, BB)
    m_b = o_b < B
    p_r = r_ptr + e.to(tl.int64) * T
    p_row = e.to(tl.int64) * B + o_b
    if HAS_N:
        n = tl.load(n_ptr)
    else:
        n = T.to(tl.float64)
    target = n * (tl.full([], K, tl.float64) / E.to(tl.float64))  # fp64: n * (k / E)
    inf = float("inf")

    if STAGE == 3:
        lo_f = tl.load(range_ptr + e)
        width_f = tl.load(range_ptr + E + e)
    else:
        lo = tl.load(ends_ptr + e)
        width = tl.maximum((-tl.load(ends_ptr + E + e) - lo) * scale, 1e-12)  # the max: in the last bin
        if STAGE == 1:
            tl.store(hc_ptr + p_row, _row_counts(p_r, T, lo, width, B, BB, BLOCK_T), mask=m_b)
        else:
            if STAGE == 0:
                at, _, _ = _row_select(p_r, T, lo, width, target, B, NH, NL, BLOCK_T)
            else:
                at, _, _ = _first_reaching(tl.load(hc_ptr + p_row, mask=m_b, other=0), target, B, BB)
            lo_f = lo + at.to(tl.float32) * width
            if RECIP_DIV:  # torch on CUDA: width / B as width * (1 / B)
                width_f = width * tl.math.div_rn(1.0, B.to(tl.float32))
            else:
                width_f = tl.math.div_rn(width, B.to(tl.float32))
            width_f = tl.maximum(width_f, 1e-12)
            if STAGE == 2:
                tl.store(range_ptr + e, lo_f)
                tl.store(range_ptr + E + e, width_f)
                tl.store(hf_ptr + p_row, _row_counts(p_r, T, lo_f, width_f, B, BB, BLOCK_T), mask=m_b)
    if STAGE == 0 or STAGE == 3:
        if STAGE == 0:
            q_bin, upto, within = _row_select(p_r, T, lo_f, width_f, target, B, NH, NL, BLOCK_T)
        else:
            q_bin, upto, within = _first_reaching(tl.load(hf_ptr + p_row, mask=m_b, other=0), target, B, BB)
        before = upto - within
        frac = (target - before.to(tl.float64)) / tl.maximum(within, 1).to(tl.float64)
        frac = tl.minimum(tl.maximum(frac, 0.0), 1.0)
        tl.store(b_ptr + e, lo_f + (q_bin.to(tl.float32) + frac.to(tl.float32)) * width_f)
        tl.store(ends_ptr + e, inf)  # reset for the next step's atomic min
        tl.store(ends_ptr + E + e, inf)


@triton.jit
def quantile_fwd_kernel_center(b_ptr, out_ptr, E, BE: tl.constexpr):
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    b_b = tl.load(b_ptr + o_e, mask=m_e, other=0.0)
    tl.store(out_ptr + o_e, b_b - tl.math.div_rn(tl.sum(b_b, axis=0), E.to(tl.float32)), mask=m_e)


@triton.jit
def quantile_fwd_kernel_extrapolate(b_ptr, y_prev_ptr, d_prev_ptr, next_ptr, E, momentum,
                                    FIRST: tl.constexpr, KEEP_FIRST: tl.constexpr, BE: tl.constexpr):
    """quantile.extrapolate on the last solve (centred first): next = y + momentum * keep * (y - y_prev), keep
    0 where the change reverses d_prev (KEEP_FIRST: no d_prev yet, kept); y_prev, d_prev = y, y - y_prev. FIRST
    (the first step's solve): next = y_prev = y."""
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    b_b = tl.load(b_ptr + o_e, mask=m_e, other=0.0)
    b_y = b_b - tl.math.div_rn(tl.sum(b_b, axis=0), E.to(tl.float32))
    if FIRST:
        b_next = b_y
    else:
        b_d = tl.where(m_e, b_y - tl.load(y_prev_ptr + o_e, mask=m_e, other=0.0), 0.0)
        if KEEP_FIRST:
            b_next = b_y + momentum * b_d
        else:
            dot = tl.sum(b_d * tl.load(d_prev_ptr + o_e, mask=m_e, other=0.0), axis=0)
            b_next = b_y + (momentum * (dot > 0).to(tl.float32)) * b_d
        tl.store(d_prev_ptr + o_e, b_d, mask=m_e)
    tl.store(y_prev_ptr + o_e, b_y, mask=m_e)
    tl.store(next_ptr + o_e, b_next, mask=m_e)


class Workspace:
    """The device buffers of one batch_bias_triton call (T tokens, E experts, B bins)."""

    def __init__(self, T: int, E: int, num_bins: int, device: torch.device, staged: bool):
        self.r_ET = torch.empty(E, T, dtype=torch.float32, device=device)
        self.ends_2E = torch.full((2, E), float("inf"), dtype=torch.float32, device=device)  # [min r, min -r]
        self.b_E = torch.empty(E, dtype=torch.float32, device=device)  # the last solve, not centred
        shape = (E, num_bins) if staged else (1, 1)
        self.coarse_EB = torch.empty(shape, dtype=torch.int32, device=device)
        self.fine_EB = torch.empty(shape, dtype=torch.int32, device=device)
        self.range_2E = torch.empty(2, E, dtype=torch.float32, device=device)  # fine [lo, width]
        self.momentum_3E = torch.empty(3, E, dtype=torch.float32, device=device)  # [y_prev, d_prev, next start]


def launch_required(s_TE: torch.Tensor, b_E: torch.Tensor, top_k: int, center: bool, ws: Workspace) -> None:
    """ws.r_ET = required biases of s_TE (fp32 contiguous) under b_E (centred first if `center`); ws.ends_2E =
    min(ends, [min_t r, min_t -r]) per expert."""
    T, E = s_TE.shape
    BE = triton.next_power_of_2(E)
    BT = _block_tokens(BE)
    quantile_fwd_kernel_required[(triton.cdiv(T, BT),)](
        s_TE, b_E, ws.r_ET, ws.ends_2E, T, E, K=top_k, CENTER=center, BT=BT, BE=BE,
        num_warps=4 if BE <= 256 else 8,
    )


def launch_extrapolate(ws: Workspace, step: int, momentum: float) -> None:
    """ws.momentum_3E[2] = the start of step `step` + 1 from the solve of `step` (quantile.extrapolate)."""
    E = ws.b_E.shape[0]
    y_prev_E, d_prev_E, next_E = ws.momentum_3E.unbind(0)
    quantile_fwd_kernel_extrapolate[(1,)](ws.b_E, y_prev_E, d_prev_E, next_E, E, momentum,
                                          FIRST=step == 0, KEEP_FIRST=step == 1, BE=triton.next_power_of_2(E),
                                          enable_fp_fusion=False)


def launch_solve(stage: int, ws: Workspace, top_k: int, num_bins: int, n: torch.Tensor | None) -> None:
    """One solve launch (STAGE_*) over ws; n: the group's token count (fp64 [1]), None = this rank's T."""
    E, T = ws.r_ET.shape
    BB = triton.next_power_of_2(num_bins)
    NL = min(BB, DIGIT_BINS)
    quantile_fwd_kernel_solve[(E,)](
        ws.r_ET, ws.ends_2E, ws.b_E if n is None else n, ws.coarse_EB, ws.fine_EB, ws.range_2E, ws.b_E,
        T, E, num_bins, (1 + 1e-6) / num_bins,
        K=top_k, STAGE=stage, HAS_N=n is not None, RECIP_DIV=ws.r_ET.is_cuda,
        BB=BB, NH=BB // NL, NL=NL, BLOCK_T=BLOCK_T_SELECT if stage == STAGE_FUSED else BLOCK_T_SOLVE,
        num_warps=8, enable_fp_fusion=False,
    )


@torch.no_grad()
def batch_bias_triton(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, num_bins: int, iterations: int,
                      group: dist.ProcessGroup | None = None, staged: bool | None = None,
                      momentum: float = 0.0) -> torch.Tensor:
    """quantile.batch_bias on the Triton kernels (same arguments, same result up to the rounding of the mean and
    of the extrapolation's dot product). staged: run the solve as its three reducible launches (default: only with
    a group of > 1 ranks)."""
    reduce = group is not None and dist.get_world_size(group) > 1
    staged = reduce if staged is None else staged
    s_TE = scores_TE.detach().float().contiguous()
    T, E = s_TE.shape
    assert 0 < top_k < E and iterations >= 1 and T > 0, (T, E, top_k, iterations)
    ws = Workspace(T, E, num_bins, s_TE.device, staged)
    n = None
    if reduce:  # tokens over the group: every expert's histogram counts each of them once
        n = torch.full((1,), float(T), dtype=torch.float64, device=s_TE.device)
        dist.all_reduce(n, group=group)
    b_E = bias_E.detach().float().contiguous()
    extrapolated = momentum > 0 and iterations > 1
    for step in range(iterations):
        if step == 0:
            launch_required(s_TE, b_E, top_k, False, ws)
        elif extrapolated:
            launch_extrapolate(ws, step - 1, momentum)
            launch_required(s_TE, ws.momentum_3E[2], top_k, False, ws)
        else:
            launch_required(s_TE, ws.b_E, top_k, True, ws)
        if reduce:
            dist.all_reduce(ws.ends_2E, op=dist.ReduceOp.MIN, group=group)
        if not staged:
            launch_solve(STAGE_FUSED, ws, top_k, num_bins, n)
            continue
        launch_solve(STAGE_COARSE, ws, top_k, num_bins, n)
        if reduce:
            dist.all_reduce(ws.coarse_EB, group=group)
        launch_solve(STAGE_FINE, ws, top_k, num_bins, n)
        if reduce:
            dist.all_reduce(ws.fine_EB, group=group)
        launch_solve(STAGE_READ, ws, top_k, num_bins, n)
    out_E = torch.empty(E, dtype=torch.float32, device=s_TE.device)
    quantile_fwd_kernel_center[(1,)](ws.b_E, out_E, E, BE=triton.next_power_of_2(E))
    return out_E


__all__ = ["Workspace", "batch_bias_triton", "launch_extrapolate", "launch_required", "launch_solve"]
