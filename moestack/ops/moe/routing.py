"""The routing dispatcher: route -> dispatch (expert-major layout) -> gather -> [grouped GEMMs] -> combine.

Backends: "triton" (fused router kernel, counting-sort permutation, gather / combine kernels; CUDA, or the CPU
interpreter under TRITON_INTERPRET=1) and "reference" (pure torch, always available; the spec).
Selection: `backend` (KernelSpec.moe.routing, set on the MoE layer at build time) > "triton" on CUDA, else
"reference".

The layout (`Dispatch`) has R rows, a static number (no host sync decides it):
    dropless, align a:   expert e owns rows [start_e, start_e + count_e), start_e = sum_{j<e} ceil(count_j/a)*a;
                         R = N if a == 1 else N + E*(a-1) (an upper bound; rows after offs_E[-1] are padding)
    capacity C:          expert e owns rows [e*C, (e+1)*C); its slots beyond C (lowest priority first) are dropped
Padding rows read no token (slot -1): gather writes zeros there, combine never reads them.

Under torch.compile each entry below is one torch.library custom op (custom_ops.py: the same code, the same backward
kernels); argument combinations a schema cannot carry run eagerly between graphs (@opaque).

Legend: T tokens, E experts, K top-k, N = T*K (token, slot) pairs ("slots", flat index t*K + k), R rows of the
expert-major buffer, D row width.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from moestack.ops.backends import Backend, ReferenceBackend, Registry
from moestack.ops.moe import custom_ops as moe_ops
from moestack.ops.moe import reference
from moestack.ops.opaque import opaque

BACKENDS = ("triton", "reference")


class Dispatch(NamedTuple):
    """Where each routed (token, slot) pair lives in the expert-major buffer, and back. All on the device."""

    row_of_slot_N: torch.Tensor  # int64 [N]: row of slot t*K+k, -1 if dropped
    slot_of_row_R: torch.Tensor  # int64 [R]: slot feeding row r, -1 for padding
    counts_E: torch.Tensor  # int64 [E]: routed slots per expert (before any drop)
    offs_E: torch.Tensor  # int32 [E]: cumulative row ends for the grouped GEMM (padding included)
    dropped: torch.Tensor  # int64 []: slots dropped by the capacity limit (0 when dropless)
    top_k: int
    exact: bool  # dropless and unpadded: rows are a permutation of the slots (R == N)


# a constant, not an lru_cache'd call: dynamo traces resolve_backend in compiled blocks and warns on those
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    if not TRITON_INSTALLED:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """backend (None / "auto": "triton" on CUDA when installed, else "reference")."""
    if backend is None or backend == "auto":
        return "triton" if device.type == "cuda" and TRITON_INSTALLED else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"MoE routing backend must be one of {BACKENDS}, got {backend!r} (kernels.moe.routing)")
    if backend == "triton" and not triton_available():
        raise ValueError("MoE routing backend 'triton' needs triton and CUDA (or TRITON_INTERPRET=1); use 'reference'")
    return backend


class _TritonRouting(Backend):
    """The Triton token path (triton_router.py, triton_permute.py, triton_activation.py); the functions below
    branch on the name, so only the checks are used."""

    name = "triton"
    fn = None

    def unavailable(self, device: torch.device) -> str | None:
        if not TRITON_INSTALLED:
            return "Triton is not installed"
        return None if device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1" else \
            "the Triton routing kernels need a CUDA device (TRITON_INTERPRET=1 runs them on CPU for tests)"


REGISTRY = Registry("MoE routing")
REGISTRY.register(_TritonRouting())
REGISTRY.register(ReferenceBackend(None))


def capacity_rows(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float, align: int = 1) -> int:
    """Rows per expert in static-capacity mode: ceil(factor * T*K / E), rounded up to `align`, at least align."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    c = math.ceil(capacity_factor * num_tokens * top_k / num_experts)
    return max(align, -(-c // align) * align)


def expert_counts(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed slots per expert, int64 [E]. An integer scatter-add: exact in any order, and unlike
    torch.bincount on CUDA (which reads the max id on the host) free of host syncs."""
    flat = idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))


# ---------------------------------------------------------------------------------------------------------------
# router logits


def _split_bf16(t: torch.Tensor) -> list[torch.Tensor]:
    """t as a sum of bf16 terms: [t] if t is bf16, else [hi, lo] with t - hi - lo = O(2^-16 |t|)."""
    if t.dtype == torch.bfloat16:
        return [t]
    hi = t.to(torch.bfloat16)
    return [hi, (t.float() - hi.float()).to(torch.bfloat16)]


_MM_OUT_DTYPE = [True]  # torch.mm(..., out_dtype=) works here (set False after the first failure)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 x bf16 -> fp32 product with fp32 accumulation (tensor cores on CUDA; exact-product emulation on CPU)."""
    if a.is_cuda and _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError, TypeError):
            _MM_OUT_DTYPE[0] = False
    return a.float() @ b.float()


def _split_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b to ~fp32 accuracy from bf16 GEMMs: sum of the split terms' products except lo x lo (O(2^-16))."""
    A, B = _split_bf16(a), _split_bf16(b)
    out = _mm_f32(A[0], B[0])
    for i, j in ((0, 1), (1, 0)):
        if i < len(A) and j < len(B):
            out = out + _mm_f32(A[i], B[j])
    return out


class _SplitBF16Logits(torch.autograd.Function):
    """logits = x W^T in fp32 from bf16 tensor-core GEMMs of split operands (x bf16: 2 GEMMs; fp32: 3); the
    same for both gradients. Products of bf16 values are exact in fp32, so the only error is the dropped lo x lo
    term and W's bits beyond 16 (~1e-5 relative), near an fp32 GEMM's own accumulation error, ~5x faster."""

    @staticmethod
    def forward(ctx, x_TD, weight_ED):
        ctx.save_for_backward(x_TD, weight_ED)
        return _split_mm(x_TD, weight_ED.t())

    @staticmethod
    def backward(ctx, grad_TE):
        x_TD, weight_ED = ctx.saved_tensors
        grad_TE = grad_TE.float()
        dx = _split_mm(grad_TE, weight_ED).to(x_TD.dtype) if ctx.needs_input_grad[0] else None
        dw = _split_mm(grad_TE.t(), x_TD).to(weight_ED.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


def router_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor, split_bf16: bool | None = None) -> torch.Tensor:
    """fp32 router logits x W^T [T, E]. split_bf16 (default: on CUDA when x is bf16): the split-bf16 GEMMs of
    _SplitBF16Logits instead of an fp32 GEMM (which runs without tensor cores: ~2 ms at K3's 8192 x 7168 x 896).
    Otherwise an exact fp32 (or fp64 for fp64 inputs) F.linear, as the reference router."""
    if split_bf16 is None:
        split_bf16 = x_TD.is_cuda and x_TD.dtype == torch.bfloat16
    if torch.compiler.is_compiling():
        return moe_ops.router_logits(x_TD, weight_ED, bool(split_bf16))
    return _router_logits_eager(x_TD, weight_ED, split_bf16)


def _router_logits_impl(x_TD: torch.Tensor, weight_ED: torch.Tensor, split_bf16: bool) -> torch.Tensor:
    with torch.autocast(x_TD.device.type, enabled=False):
        if split_bf16:
            return _SplitBF16Logits.apply(x_TD, weight_ED)
        dtype = torch.promote_types(x_TD.dtype, torch.float32)
        return F.linear(x_TD.to(dtype), weight_ED.to(dtype))


_router_logits_eager = opaque(_router_logits_impl)


# ---------------------------------------------------------------------------------------------------------------
# route


def route(
    logits_TE: torch.Tensor,
    bias_E: torch.Tensor | None,
    top_k: int,
    score: str = "sigmoid",
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.route plus per-expert slot counts: (topk_idx_TK int64, topk_w_TK, scores_TE, counts_E int64).

    The Triton kernel takes fp32 logits (the router's dtype); other dtypes (fp64 tests) take the reference.
    """
    if torch.compiler.is_compiling():
        w, scores, idx, counts = moe_ops.route(logits_TE, bias_E, int(top_k), score, int(num_groups),
                                               int(topk_groups), bool(renormalize), float(scaling), backend)
        return idx, w, scores, counts
    return _route_eager(logits_TE, bias_E, top_k, score, num_groups, topk_groups, renormalize, scaling, backend)


def _route_impl(logits_TE, bias_E, top_k, score, num_groups, topk_groups, renormalize, scaling, backend):
    name = resolve_backend(backend, logits_TE.device)
    if name == "triton" and logits_TE.dtype == torch.float32:
        from moestack.ops.moe.triton_router import route_triton

        return route_triton(logits_TE, bias_E, top_k, score, num_groups, topk_groups, renormalize, scaling)
    idx, w, scores = reference.route(logits_TE, bias_E, top_k, score, num_groups, topk_groups, renormalize, scaling)
    counts = expert_counts(idx, logits_TE.shape[1])
    return idx, w, scores, counts


_route_eager = opaque(_route_impl)


# ---------------------------------------------------------------------------------------------------------------
# dispatch


def _slot_of_row(row_of_slot_N: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Invert row_of_slot (dropped slots, -1, land in a discarded extra row); padding rows stay -1."""
    N = row_of_slot_N.numel()
    out = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=row_of_slot_N.device)
    target = torch.where(row_of_slot_N >= 0, row_of_slot_N, num_rows)
    out.scatter_(0, target, torch.arange(N, device=row_of_slot_N.device))
    return out[:num_rows]


def _dispatch_capacity(
    flat_N: torch.Tensor, counts_E: torch.Tensor, num_experts: int, cap: int, priority_N: torch.Tensor, top_k: int
) -> Dispatch:
    """Static capacity: per expert keep the `cap` slots of highest priority (ties: lower slot index), drop the
    rest. Two stable device sorts (priority, then expert) give that order without a host sync."""
    N = flat_N.numel()
    by_priority_N = torch.sort(priority_N.detach(), descending=True, stable=True).indices
    order_N = by_priority_N[torch.sort(flat_N[by_priority_N], stable=True).indices]
    expert_sorted_N = flat_N[order_N]
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_N = torch.arange(N, device=flat_N.device) - starts_E[expert_sorted_N]
    row_sorted_N = torch.where(rank_N < cap, expert_sorted_N * cap + rank_N, -1)
    row_of_slot_N = torch.empty_like(row_sorted_N).scatter_(0, order_N, row_sorted_N)
    offs_E = (torch.arange(1, num_experts + 1, device=flat_N.device) * cap).to(torch.int32)
    dropped = (counts_E - cap).clamp_min(0).sum()
    return Dispatch(row_of_slot_N, _slot_of_row(row_of_slot_N, num_experts * cap), counts_E, offs_E, dropped,
                    top_k, False)


def _dispatch_reference(topk_idx_TK: torch.Tensor, num_experts: int, align: int) -> Dispatch:
    """Dropless layout from one stable sort (reference.permute), with optional per-expert row padding."""
    T, K = topk_idx_TK.shape
    N = T * K
    perm = reference.permute(topk_idx_TK, num_experts)
    if align == 1:
        zero = torch.zeros((), dtype=torch.int64, device=topk_idx_TK.device)
        return Dispatch(perm.inverse_N, perm.order_N, perm.counts_E, perm.offs_E, zero, K, True)
    counts_E = perm.counts_E
    padded_E = (counts_E + align - 1) // align * align
    shift_E = (torch.cumsum(padded_E, 0) - padded_E) - (torch.cumsum(counts_E, 0) - counts_E)
    expert_sorted_N = topk_idx_TK.reshape(-1)[perm.order_N]
    row_sorted_N = torch.arange(N, device=topk_idx_TK.device) + shift_E[expert_sorted_N]
    row_of_slot_N = torch.empty_like(row_sorted_N).scatter_(0, perm.order_N, row_sorted_N)
    R = N + num_experts * (align - 1)
    zero = torch.zeros((), dtype=torch.int64, device=topk_idx_TK.device)
    offs_E = torch.cumsum(padded_E, 0).to(torch.int32)
    return Dispatch(row_of_slot_N, _slot_of_row(row_of_slot_N, R), counts_E, offs_E, zero, K, False)


def dispatch(
    topk_idx_TK: torch.Tensor,
    num_experts: int,
    align: int = 1,
    capacity: int | None = None,
    priority_TK: torch.Tensor | None = None,
    backend: str | None = None,
) -> Dispatch:
    """The expert-major layout of the routed slots; no host sync on either backend.

    Args:
        topk_idx_TK: int64 [T, K] chosen experts.
        align: pad each expert's row block to a multiple of this (dropless mode); 1 = no padding.
        capacity: rows per expert (static-capacity mode, see `capacity_rows`); None = dropless.
        priority_TK: [T, K] drop order in capacity mode (higher kept first; the layer passes the routing
            weights). Required with capacity.
    Within an expert the kept slots are in token order (dropless) or priority order (capacity).
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if capacity is not None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 row per expert, got {capacity}")
        if priority_TK is None or priority_TK.shape != topk_idx_TK.shape:
            raise ValueError("capacity mode needs priority_TK with topk_idx_TK's shape (e.g. the routing weights)")
    if torch.compiler.is_compiling():  # the op returns the tensors; the ints and bools follow from the arguments
        capacity = None if capacity is None else int(capacity)
        priority = None if priority_TK is None or capacity is None else priority_TK.detach()
        tensors = moe_ops.dispatch(topk_idx_TK, int(num_experts), int(align), capacity, priority, backend)
        return Dispatch(*tensors, topk_idx_TK.shape[1], capacity is None and align == 1)
    return _dispatch_eager(topk_idx_TK, num_experts, align, capacity, priority_TK, backend)


def _dispatch_impl(topk_idx_TK, num_experts, align, capacity, priority_TK, backend) -> Dispatch:
    K = topk_idx_TK.shape[1]
    flat_N = topk_idx_TK.reshape(-1)
    if capacity is not None:
        counts_E = expert_counts(flat_N, num_experts)
        return _dispatch_capacity(flat_N, counts_E, num_experts, capacity, priority_TK.reshape(-1), K)
    if resolve_backend(backend, topk_idx_TK.device) == "triton":
        from moestack.ops.moe.triton_permute import dispatch_triton

        return dispatch_triton(topk_idx_TK, num_experts, align)
    return _dispatch_reference(topk_idx_TK, num_experts, align)


_dispatch_eager = opaque(_dispatch_impl)


# ---------------------------------------------------------------------------------------------------------------
# gather / combine


def _as_permutation(slot_of_row_R: torch.Tensor, row_of_slot_N: torch.Tensor, K: int) -> reference.Permutation:
    """The exact layout as reference.permute's (gather_sorted / unpermute_combine read neither counts nor offs)."""
    return reference.Permutation(slot_of_row_R, row_of_slot_N, slot_of_row_R // K, None, None)


class _GatherRows(torch.autograd.Function):
    """x_RD[r] = h_TD[slot_of_row[r] // K] (zero for padding rows); backward sums each token's K row gradients
    in slot order (deterministic; dropped slots add nothing)."""

    @staticmethod
    def forward(ctx, h_TD, slot_of_row_R, row_of_slot_N, K):
        T, D = h_TD.shape
        ctx.save_for_backward(row_of_slot_N)
        ctx.K = K
        h_pad = torch.cat([h_TD, h_TD.new_zeros((1, D))])
        return h_pad[torch.where(slot_of_row_R >= 0, slot_of_row_R // K, T)]

    @staticmethod
    def backward(ctx, grad_RD):
        (row_of_slot_N,) = ctx.saved_tensors
        R, D = grad_RD.shape
        g_pad = torch.cat([grad_RD, grad_RD.new_zeros((1, D))])
        g_TKD = g_pad[torch.where(row_of_slot_N >= 0, row_of_slot_N, R)].view(-1, ctx.K, D)
        return g_TKD.sum(1, dtype=torch.promote_types(grad_RD.dtype, torch.float32)).to(grad_RD.dtype), None, None, None


def gather(h_TD: torch.Tensor, d: Dispatch, backend: str | None = None) -> torch.Tensor:
    """Expert-major copy of the routed inputs [R, D] (padding rows zero). Deterministic forward and backward."""
    if torch.compiler.is_compiling():
        return moe_ops.gather(h_TD, d.slot_of_row_R, d.row_of_slot_N, d.top_k, d.exact, backend)
    return _gather_eager(h_TD, d.slot_of_row_R, d.row_of_slot_N, d.top_k, d.exact, backend)


def _gather_impl(h_TD, slot_of_row_R, row_of_slot_N, K: int, exact: bool, backend: str | None) -> torch.Tensor:
    if resolve_backend(backend, h_TD.device) == "triton":
        from moestack.ops.moe.triton_permute import _GatherTriton

        return _GatherTriton.apply(h_TD, slot_of_row_R, row_of_slot_N, K)
    if exact:
        return reference.gather_sorted(h_TD, _as_permutation(slot_of_row_R, row_of_slot_N, K), K)
    return _GatherRows.apply(h_TD, slot_of_row_R, row_of_slot_N, K)


_gather_eager = opaque(_gather_impl)


def combine(y_RD: torch.Tensor, d: Dispatch, topk_w_TK: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """y_TD[t] = sum_k w[t, k] * y_RD[row of (t, k)] (dropped slots add nothing), summed over k in order in
    fp32; returns y_RD's dtype. Deterministic forward and backward, no atomics."""
    if torch.compiler.is_compiling():
        return moe_ops.combine(y_RD, topk_w_TK, d.slot_of_row_R, d.row_of_slot_N, d.exact, backend)
    return _combine_eager(y_RD, topk_w_TK, d.slot_of_row_R, d.row_of_slot_N, d.exact, backend)


def _combine_impl(y_RD, topk_w_TK, slot_of_row_R, row_of_slot_N, exact: bool, backend: str | None) -> torch.Tensor:
    if resolve_backend(backend, y_RD.device) == "triton":
        from moestack.ops.moe.triton_permute import _CombineTriton

        return _CombineTriton.apply(y_RD, topk_w_TK, slot_of_row_R, row_of_slot_N, exact)
    T, K = topk_w_TK.shape
    if exact:
        return reference.unpermute_combine(y_RD, _as_permutation(slot_of_row_R, row_of_slot_N, K), topk_w_TK)
    R, D = y_RD.shape
    dtype = torch.promote_types(torch.promote_types(y_RD.dtype, topk_w_TK.dtype), torch.float32)
    y_pad = torch.cat([y_RD, y_RD.new_zeros((1, D))])
    y_TKD = y_pad[torch.where(row_of_slot_N >= 0, row_of_slot_N, R)].view(T, K, D)
    return (y_TKD.to(dtype) * topk_w_TK.to(dtype).unsqueeze(-1)).sum(1).to(y_RD.dtype)


_combine_eager = opaque(_combine_impl)


__all__ = [
    "BACKENDS",
    "Dispatch",
    "capacity_rows",
    "combine",
    "dispatch",
    "expert_counts",
    "gather",
    "resolve_backend",
    "route",
    "router_logits",
    "triton_available",
]
