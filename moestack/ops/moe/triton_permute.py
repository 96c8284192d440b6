"""Triton permutation kernels: counting-sort dispatch, row gather, weighted combine (and their backwards).

    dispatch:  per chunk of BLOCK slots a histogram over experts (no atomics: each program owns one row of
               hist [chunks, E]) -> exclusive prefix sums over chunks and experts (torch cumsum, on device) ->
               each slot's row = base[chunk, e] + its rank among earlier same-expert slots of its chunk.
               Stable (token order within an expert, as reference.permute), no argsort, no host sync.
    gather:    row-major copy x[r] = h[slot_of_row[r] // K], zeros on padding rows.
    combine:   token-major y[t] = sum_k w[t,k] * x[row_of_slot[t,k]], k in order, fp32 (no atomics). The same
               kernel without weights is gather's backward.
    combine backward: token-major, one pass: dy[row(t,k)] = w[t,k] * g[t] (unique rows, plain stores) and
               dw[t,k] = <y[row(t,k)], g[t]> accumulated over D blocks in order; padding rows of dy are zeroed.

Legend: T tokens, E experts, K top-k, N = T*K slots, R rows, D width. routing.py has the layout contract.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moestack.ops.launch import pruner
from moestack.ops.moe.routing import Dispatch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _configs(configs: list[triton.Config]) -> list[triton.Config]:
    """Autotuning needs a GPU: keep the first config under the interpreter."""
    return configs[:1] if INTERPRET else configs


_PRUNE = {"early_config_prune": pruner("tile")}  # fixed [rows, BD] tiles, no dots (launch.py)


# ---- dispatch --------------------------------------------------------------------------------------------------


@triton.jit
def permute_fwd_kernel_hist(idx_ptr, hist_ptr, N, E, BLOCK: tl.constexpr, BE: tl.constexpr):
    """hist[chunk, e] = slots of expert e among this chunk's BLOCK slots."""
    pid = tl.program_id(0)
    o_n = pid * BLOCK + tl.arange(0, BLOCK)
    b_e = tl.load(idx_ptr + o_n, mask=o_n < N, other=-1).to(tl.int32)  # [BLOCK]
    for e0 in range(0, E, BE):
        o_e = e0 + tl.arange(0, BE)
        b_h = tl.sum((b_e[:, None] == o_e[None, :]).to(tl.int32), axis=0)  # [BE]
        tl.store(hist_ptr + pid.to(tl.int64) * E + o_e, b_h, mask=o_e < E)


@triton.jit
def permute_fwd_kernel_scatter(
    idx_ptr, base_ptr, row_of_slot_ptr, slot_of_row_ptr, N, E, BLOCK: tl.constexpr, SUB: tl.constexpr
):
    """row = base[chunk, e] + #(earlier slots of this chunk with the same expert); writes both directions."""
    pid = tl.program_id(0)
    o_n = pid * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < N
    b_e = tl.load(idx_ptr + o_n, mask=m_n, other=-1).to(tl.int32)  # [BLOCK]
    b_rank = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, BLOCK, SUB):
        o_j = pid * BLOCK + j0 + tl.arange(0, SUB)
        b_ej = tl.load(idx_ptr + o_j, mask=o_j < N, other=-2).to(tl.int32)  # [SUB]
        same = (b_e[:, None] == b_ej[None, :]) & (o_j[None, :] < o_n[:, None])  # [BLOCK, SUB]
        b_rank += tl.sum(same.to(tl.int32), axis=1)
    b_base = tl.load(base_ptr + pid.to(tl.int64) * E + b_e, mask=m_n, other=0)
    b_row = b_base + b_rank
    tl.store(row_of_slot_ptr + o_n, b_row.to(tl.int64), mask=m_n)
    tl.store(slot_of_row_ptr + b_row, o_n.to(tl.int64), mask=m_n)


def dispatch_triton(topk_idx_TK: torch.Tensor, num_experts: int, align: int = 1) -> Dispatch:
    """Dropless expert-major layout by counting sort (see module docstring); routing.dispatch has the contract."""
    T, K = topk_idx_TK.shape
    N, E = T * K, num_experts
    dev = topk_idx_TK.device
    idx_N = topk_idx_TK.reshape(-1).contiguous()
    BLOCK = 32 if INTERPRET else 256
    BE = 32 if INTERPRET else 64
    chunks = triton.cdiv(N, BLOCK)
    hist_CE = torch.empty((chunks, E), dtype=torch.int32, device=dev)
    permute_fwd_kernel_hist[(chunks,)](idx_N, hist_CE, N, E, BLOCK=BLOCK, BE=BE, num_warps=4)
    counts_E = hist_CE.sum(0, dtype=torch.int64)
    padded_E = counts_E if align == 1 else (counts_E + align - 1) // align * align
    ends_E = torch.cumsum(padded_E, 0)
    base_CE = (torch.cumsum(hist_CE, 0, dtype=torch.int32) - hist_CE) + (ends_E - padded_E).to(torch.int32)
    R = N if align == 1 else N + E * (align - 1)
    row_of_slot_N = torch.empty(N, dtype=torch.int64, device=dev)
    # padding rows keep -1; without padding every row is written
    slot_of_row_R = torch.full((R,), -1, dtype=torch.int64, device=dev) if align > 1 else row_of_slot_N.new_empty(R)
    permute_fwd_kernel_scatter[(chunks,)](
        idx_N, base_CE, row_of_slot_N, slot_of_row_R, N, E, BLOCK=BLOCK, SUB=min(32, BLOCK), num_warps=4
    )
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    return Dispatch(row_of_slot_N, slot_of_row_R, counts_E, ends_E.to(torch.int32), zero, K, align == 1)


# ---- gather / combine --------------------------------------------------------------------------------------------


@triton.autotune(
    configs=_configs([
        triton.Config({"BR": 16, "BD": 256}, num_warps=4),
        triton.Config({"BR": 32, "BD": 128}, num_warps=4),
        triton.Config({"BR": 8, "BD": 512}, num_warps=8),
    ]),
    key=["D"],
    prune_configs_by=_PRUNE,
)
@triton.jit
def gather_fwd_kernel(h_ptr, slot_of_row_ptr, x_ptr, R, D, K, BR: tl.constexpr, BD: tl.constexpr):
    """x[r] = h[slot_of_row[r] // K]; padding rows (slot -1) get zeros."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_r, m_d = o_r < R, o_d < D
    b_slot = tl.load(slot_of_row_ptr + o_r, mask=m_r, other=-1)
    b_t = tl.where(b_slot >= 0, b_slot // K, 0).to(tl.int64)
    b_x = tl.load(h_ptr + b_t[:, None] * D + o_d[None, :], mask=(b_slot >= 0)[:, None] & m_d[None, :], other=0.0)
    tl.store(x_ptr + o_r.to(tl.int64)[:, None] * D + o_d[None, :], b_x, mask=m_r[:, None] & m_d[None, :])


@triton.autotune(
    configs=_configs([
        triton.Config({"BT": 8, "BD": 256}, num_warps=4),
        triton.Config({"BT": 16, "BD": 128}, num_warps=4),
        triton.Config({"BT": 4, "BD": 512}, num_warps=8),
    ]),
    key=["D", "K", "HAS_W"],
    prune_configs_by=_PRUNE,
)
@triton.jit
def combine_fwd_kernel(
    x_ptr, row_of_slot_ptr, w_ptr, y_ptr, T, D, K: tl.constexpr, HAS_W: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr
):
    """y[t] = sum_k w[t,k] * x[row_of_slot[t,k]] in fp32, k in order (w = 1 without HAS_W: gather's backward)."""
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_t, m_d = o_t < T, o_d < D
    b_acc = tl.zeros([BT, BD], dtype=tl.float32)
    for k in range(K):
        b_row = tl.load(row_of_slot_ptr + o_t * K + k, mask=m_t, other=-1)
        b_x = tl.load(x_ptr + b_row[:, None] * D + o_d[None, :], mask=(b_row >= 0)[:, None] & m_d[None, :],
                      other=0.0).to(tl.float32)
        if HAS_W:
            b_w = tl.load(w_ptr + o_t * K + k, mask=m_t, other=0.0).to(tl.float32)
            b_acc += b_x * b_w[:, None]
        else:
            b_acc += b_x
    tl.store(y_ptr + o_t.to(tl.int64)[:, None] * D + o_d[None, :], b_acc.to(y_ptr.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])


@triton.autotune(
    configs=_configs([
        triton.Config({"BT": 4, "BD": 256}, num_warps=4),
        triton.Config({"BT": 8, "BD": 128}, num_warps=4),
        triton.Config({"BT": 2, "BD": 512}, num_warps=4),
    ]),
    key=["D", "K"],
    prune_configs_by=_PRUNE,
)
@triton.jit
def combine_bwd_kernel(
    g_ptr, x_ptr, w_ptr, row_of_slot_ptr, dx_ptr, dw_ptr, T, D, K: tl.constexpr, KP: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr
):
    """dx[row(t,k)] = w[t,k] * g[t]; dw[t,k] = <x[row(t,k)], g[t]> (fp32, D blocks in order). Dropped slots:
    dw = 0, nothing stored."""
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_k = tl.arange(0, KP)
    m_t = o_t < T
    b_dw = tl.zeros([BT, KP], dtype=tl.float32)
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        m_d = o_d < D
        b_g = tl.load(g_ptr + o_t.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_t[:, None] & m_d[None, :],
                      other=0.0).to(tl.float32)  # [BT, BD]
        for k in range(K):
            b_row = tl.load(row_of_slot_ptr + o_t * K + k, mask=m_t, other=-1)
            m_x = (b_row >= 0)[:, None] & m_d[None, :]
            b_w = tl.load(w_ptr + o_t * K + k, mask=m_t, other=0.0).to(tl.float32)
            b_x = tl.load(x_ptr + b_row[:, None] * D + o_d[None, :], mask=m_x, other=0.0).to(tl.float32)
            b_dw += tl.where(o_k[None, :] == k, tl.sum(b_x * b_g, axis=1)[:, None], 0.0)
            tl.store(dx_ptr + b_row[:, None] * D + o_d[None, :], (b_g * b_w[:, None]).to(dx_ptr.dtype.element_ty),
                     mask=m_x)
    tl.store(dw_ptr + o_t[:, None] * K + o_k[None, :], b_dw, mask=m_t[:, None] & (o_k[None, :] < K))


@triton.jit
def zero_padding_rows_kernel(slot_of_row_ptr, x_ptr, R, D, BR: tl.constexpr, BD: tl.constexpr):
    """x[r] = 0 where slot_of_row[r] < 0 (rows no slot writes)."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    b_slot = tl.load(slot_of_row_ptr + o_r, mask=o_r < R, other=0)
    m_r = (o_r < R) & (b_slot < 0)
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        tl.store(x_ptr + o_r.to(tl.int64)[:, None] * D + o_d[None, :], tl.zeros([BR, BD], x_ptr.dtype.element_ty),
                 mask=m_r[:, None] & (o_d[None, :] < D))


def _combine(x_RD: torch.Tensor, row_of_slot_N: torch.Tensor, w_TK: torch.Tensor | None, T: int, K: int,
             dtype: torch.dtype) -> torch.Tensor:
    D = x_RD.shape[1]
    y_TD = torch.empty((T, D), dtype=dtype, device=x_RD.device)
    def grid(meta):
        return (triton.cdiv(T, meta["BT"]), triton.cdiv(D, meta["BD"]))
    combine_fwd_kernel[grid](x_RD, row_of_slot_N, w_TK if w_TK is not None else x_RD, y_TD, T, D, K=K,
                             HAS_W=w_TK is not None)
    return y_TD


class _GatherTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, slot_of_row_R, row_of_slot_N, K):
        h_TD = h_TD.contiguous()
        T, D = h_TD.shape
        R = slot_of_row_R.numel()
        x_RD = torch.empty((R, D), dtype=h_TD.dtype, device=h_TD.device)
        def grid(meta):
            return (triton.cdiv(R, meta["BR"]), triton.cdiv(D, meta["BD"]))
        gather_fwd_kernel[grid](h_TD, slot_of_row_R, x_RD, R, D, K)
        ctx.save_for_backward(row_of_slot_N)
        ctx.T, ctx.K = T, K
        return x_RD

    @staticmethod
    def backward(ctx, grad_RD):
        (row_of_slot_N,) = ctx.saved_tensors
        return _combine(grad_RD.contiguous(), row_of_slot_N, None, ctx.T, ctx.K, grad_RD.dtype), None, None, None


class _CombineTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, w_TK, slot_of_row_R, row_of_slot_N, exact):
        x_RD, w_TK = x_RD.contiguous(), w_TK.contiguous()
        T, K = w_TK.shape
        ctx.save_for_backward(x_RD, w_TK, slot_of_row_R, row_of_slot_N)
        ctx.exact = exact
        return _combine(x_RD, row_of_slot_N, w_TK, T, K, x_RD.dtype)

    @staticmethod
    def backward(ctx, grad_TD):
        x_RD, w_TK, slot_of_row_R, row_of_slot_N = ctx.saved_tensors
        grad_TD = grad_TD.contiguous()
        T, K = w_TK.shape
        R, D = x_RD.shape
        dx_RD = torch.empty_like(x_RD)
        dw_TK = torch.empty((T, K), dtype=torch.float32, device=x_RD.device)
        def grid(meta):
            return (triton.cdiv(T, meta["BT"]),)
        combine_bwd_kernel[grid](grad_TD, x_RD, w_TK, row_of_slot_N, dx_RD, dw_TK, T, D, K=K,
                                 KP=triton.next_power_of_2(K))
        if not ctx.exact:  # padding rows and dropped capacity rows are fed by no slot: zero their gradient
            BR, BD = 16, (64 if INTERPRET else 256)
            zero_padding_rows_kernel[(triton.cdiv(R, BR),)](slot_of_row_R, dx_RD, R, D, BR=BR, BD=BD)
        return dx_RD, dw_TK.to(w_TK.dtype), None, None, None


def gather_triton(h_TD: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """Triton routing.gather: [R, D] in h's dtype."""
    return _GatherTriton.apply(h_TD, d.slot_of_row_R, d.row_of_slot_N, d.top_k)


def combine_triton(y_RD: torch.Tensor, d: Dispatch, topk_w_TK: torch.Tensor) -> torch.Tensor:
    """Triton routing.combine: [T, D] in y's dtype."""
    return _CombineTriton.apply(y_RD, topk_w_TK, d.slot_of_row_R, d.row_of_slot_N, d.exact)
