"""The MoE token path and grouped GEMM as torch.library custom ops: what a compiled block calls (one graph node each,
no break; CUDA graphs capture their kernels; selective recompute sees them by name). Eager calls run the entry points'
own paths (routing.py, __init__.grouped_mm); these run the same code, and their backwards the same kernels.

    moestack::moe_router_logits (+ _backward)   routing.router_logits: split-bf16 GEMMs or an fp32 F.linear
    moestack::moe_route (+ _backward)           routing.route: the Triton router, or the reference
    moestack::moe_dispatch                      routing.dispatch's tensors (integers: no gradient)
    moestack::moe_gather (+ _backward)          routing.gather
    moestack::moe_combine (+ _backward)         routing.combine
    moestack::moe_grouped_mm (+ _backward)      the picked grouped GEMM backend (Triton, torch native, fallbacks)

Backwards: the autograd.Functions' own backward kernels on a rebuilt ctx (Triton router / gather / combine / GEMM,
the split-bf16 logits, the reference gathers), torch's grouped GEMM for its native path, and for the pure-torch paths
without a Function (the reference route and combine, the grouped GEMM's padded / loop fallbacks: CPU and test paths)
torch.func.vjp of the forward again. The kernel modules are imported inside the op bodies: importing this module
needs no Triton.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.library import custom_op


def _none_if_empty(t: torch.Tensor) -> torch.Tensor | None:
    """Custom ops return no None: an empty tensor stands for "no gradient"."""
    return None if t.numel() == 0 else t


def _vjp(fn, primals: tuple, cotangents) -> tuple:
    """Gradients of fn's outputs at primals by differentiating fn again (torch.func: an op's body runs below the
    autograd key, where torch.autograd records nothing). For the pure-torch paths only."""
    _, vjp = torch.func.vjp(fn, *primals)
    return vjp(cotangents)


# ---------------------------------------------------------------------------------------------------------------
# router logits: fp32 [T, E]


@custom_op("moestack::moe_router_logits", mutates_args=())
def router_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor, split_bf16: bool) -> torch.Tensor:
    from moestack.ops.moe.routing import _router_logits_impl

    with torch.no_grad():
        return _router_logits_impl(x_TD, weight_ED, split_bf16)


@router_logits.register_fake
def _(x_TD, weight_ED, split_bf16):
    dtype = torch.float32 if split_bf16 else torch.promote_types(x_TD.dtype, torch.float32)
    return x_TD.new_empty((x_TD.shape[0], weight_ED.shape[0]), dtype=dtype)


@custom_op("moestack::moe_router_logits_backward", mutates_args=())
def router_logits_backward(x_TD: torch.Tensor, weight_ED: torch.Tensor, grad_TE: torch.Tensor, split_bf16: bool,
                           need_dx: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from moestack.ops.moe.routing import _SplitBF16Logits

    with torch.autocast(x_TD.device.type, enabled=False):
        if split_bf16:
            ctx = SimpleNamespace(saved_tensors=(x_TD, weight_ED), needs_input_grad=(need_dx, need_dw))
            dx, dw = _SplitBF16Logits.backward(ctx, grad_TE)
        else:  # F.linear's own formulas (mm's backward for contiguous operands), then the casts' backward
            dtype = torch.promote_types(x_TD.dtype, torch.float32)
            dx = grad_TE.mm(weight_ED.to(dtype)).to(x_TD.dtype) if need_dx else None
            dw = grad_TE.t().mm(x_TD.to(dtype)).to(weight_ED.dtype) if need_dw else None
    return (x_TD.new_empty(0) if dx is None else dx), (weight_ED.new_empty(0) if dw is None else dw)


@router_logits_backward.register_fake
def _(x_TD, weight_ED, grad_TE, split_bf16, need_dx, need_dw):
    return (torch.empty_like(x_TD) if need_dx else x_TD.new_empty(0),
            torch.empty_like(weight_ED) if need_dw else weight_ED.new_empty(0))


def _logits_setup(ctx, inputs, output) -> None:
    x_TD, weight_ED, split_bf16 = inputs
    ctx.save_for_backward(x_TD, weight_ED)
    ctx.split_bf16 = split_bf16


def _logits_backward(ctx, grad_TE):
    x_TD, weight_ED = ctx.saved_tensors
    dx, dw = router_logits_backward(x_TD, weight_ED, grad_TE, ctx.split_bf16, *ctx.needs_input_grad[:2])
    return _none_if_empty(dx), _none_if_empty(dw), None


router_logits.register_autograd(_logits_backward, setup_context=_logits_setup)

# ---------------------------------------------------------------------------------------------------------------
# route: (topk_w [T, K], scores [T, E], topk_idx int64 [T, K], counts int64 [E]) (routing.route's order: idx first;
# the floats lead here so that opcheck's sum over the outputs starts with them)


def _route_runs_triton(logits_TE: torch.Tensor, backend: str | None) -> bool:
    """routing.route's choice (device type and dtype only: valid on fake tensors)."""
    from moestack.ops.moe.routing import resolve_backend

    return resolve_backend(backend, logits_TE.device) == "triton" and logits_TE.dtype == torch.float32


@custom_op("moestack::moe_route", mutates_args=())
def route(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, score: str, num_groups: int,
          topk_groups: int, renormalize: bool, scaling: float,
          backend: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from moestack.ops.moe.routing import _route_impl

    with torch.no_grad():
        idx, w, scores, counts = _route_impl(logits_TE, bias_E, top_k, score, num_groups, topk_groups, renormalize,
                                             scaling, backend)
    return w, scores, idx.contiguous(), counts  # the reference's top-k ids are a column slice of its sort


@route.register_fake
def _(logits_TE, bias_E, top_k, score, num_groups, topk_groups, renormalize, scaling, backend):
    T, E = logits_TE.shape
    dtype = torch.promote_types(logits_TE.dtype, torch.float32)
    return (logits_TE.new_empty((T, top_k), dtype=dtype), logits_TE.new_empty((T, E), dtype=dtype),
            logits_TE.new_empty((T, top_k), dtype=torch.int64), logits_TE.new_empty((E,), dtype=torch.int64))


@custom_op("moestack::moe_route_backward", mutates_args=())
def route_backward(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, scores_TE: torch.Tensor,
                   idx_TK: torch.Tensor, w_TK: torch.Tensor, dw_TK: torch.Tensor, dscores_TE: torch.Tensor,
                   top_k: int, score: str, num_groups: int, topk_groups: int, renormalize: bool, scaling: float,
                   backend: str | None) -> torch.Tensor:
    if not _route_runs_triton(logits_TE, backend):
        from moestack.ops.moe import reference

        def fwd(logits):
            return reference.route(logits, bias_E, top_k, score, num_groups, topk_groups, renormalize, scaling)[1:]

        (dlogits,) = _vjp(fwd, (logits_TE,), (dw_TK, dscores_TE))
        return dlogits
    import triton

    from moestack.ops.moe.triton_router import _block_tokens, _RouteTriton

    T, E = scores_TE.shape
    BE = triton.next_power_of_2(E)  # the forward's launch shape (_RouteTriton.forward)
    ctx = SimpleNamespace(saved_tensors=(scores_TE, idx_TK, w_TK),
                          cfg=(top_k, score == "softmax", renormalize, float(scaling), _block_tokens(BE), BE,
                               triton.next_power_of_2(top_k)))
    return _RouteTriton.backward(ctx, None, dw_TK, dscores_TE, None)[0]


@route_backward.register_fake
def _(logits_TE, bias_E, scores_TE, idx_TK, w_TK, dw_TK, dscores_TE, top_k, score, num_groups, topk_groups,
      renormalize, scaling, backend):
    return scores_TE.new_empty(scores_TE.shape, dtype=logits_TE.dtype)


def _route_setup(ctx, inputs, output) -> None:
    logits_TE, bias_E, *cfg = inputs
    w_TK, scores_TE, idx_TK, _ = output
    triton_ran = _route_runs_triton(logits_TE, cfg[-1])
    # the Triton backward reads the outputs only (an empty stand-in keeps logits' device and dtype); the
    # reference's differentiates its forward again from the inputs
    ctx.save_for_backward(logits_TE.new_empty((0, logits_TE.shape[1])) if triton_ran else logits_TE,
                          None if triton_ran else bias_E, scores_TE, idx_TK, w_TK)
    ctx.cfg = cfg


def _route_backward(ctx, dw_TK, dscores_TE, _didx, _dcounts):
    logits_TE, bias_E, scores_TE, idx_TK, w_TK = ctx.saved_tensors
    dlogits = route_backward(logits_TE, bias_E, scores_TE, idx_TK, w_TK, dw_TK, dscores_TE, *ctx.cfg)
    return dlogits, None, None, None, None, None, None, None, None


route.register_autograd(_route_backward, setup_context=_route_setup)

# ---------------------------------------------------------------------------------------------------------------
# dispatch: the tensors of routing.Dispatch (its top_k and exact come from the arguments)


@custom_op("moestack::moe_dispatch", mutates_args=())
def dispatch(topk_idx_TK: torch.Tensor, num_experts: int, align: int, capacity: int | None,
             priority_TK: torch.Tensor | None, backend: str | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from moestack.ops.moe.routing import _dispatch_impl

    with torch.no_grad():
        d = _dispatch_impl(topk_idx_TK, num_experts, align, capacity, priority_TK, backend)
    return d.row_of_slot_N, d.slot_of_row_R, d.counts_E, d.offs_E, d.dropped


def dispatch_rows(num_slots: int, num_experts: int, align: int, capacity: int | None) -> int:
    """R, the rows of the expert-major buffer (routing.py's layout contract)."""
    if capacity is not None:
        return num_experts * capacity
    return num_slots if align == 1 else num_slots + num_experts * (align - 1)


@dispatch.register_fake
def _(topk_idx_TK, num_experts, align, capacity, priority_TK, backend):
    N = topk_idx_TK.shape[0] * topk_idx_TK.shape[1]
    i64 = torch.int64
    return (topk_idx_TK.new_empty((N,), dtype=i64),
            topk_idx_TK.new_empty((dispatch_rows(N, num_experts, align, capacity),), dtype=i64),
            topk_idx_TK.new_empty((num_experts,), dtype=i64), topk_idx_TK.new_empty((num_experts,), dtype=torch.int32),
            topk_idx_TK.new_empty((), dtype=i64))


# ---------------------------------------------------------------------------------------------------------------
# gather: h [T, D] -> x [R, D]


@custom_op("moestack::moe_gather", mutates_args=())
def gather(h_TD: torch.Tensor, slot_of_row_R: torch.Tensor, row_of_slot_N: torch.Tensor, top_k: int, exact: bool,
           backend: str | None) -> torch.Tensor:
    from moestack.ops.moe.routing import _gather_impl

    with torch.no_grad():
        return _gather_impl(h_TD, slot_of_row_R, row_of_slot_N, top_k, exact, backend)


@gather.register_fake
def _(h_TD, slot_of_row_R, row_of_slot_N, top_k, exact, backend):
    return h_TD.new_empty((slot_of_row_R.shape[0], h_TD.shape[1]))


@custom_op("moestack::moe_gather_backward", mutates_args=())
def gather_backward(grad_RD: torch.Tensor, slot_of_row_R: torch.Tensor, row_of_slot_N: torch.Tensor, top_k: int,
                    exact: bool, backend: str | None) -> torch.Tensor:
    from moestack.ops.moe import reference
    from moestack.ops.moe.routing import _GatherRows, resolve_backend

    T = row_of_slot_N.shape[0] // top_k
    if resolve_backend(backend, grad_RD.device) == "triton":
        from moestack.ops.moe.triton_permute import _GatherTriton

        ctx = SimpleNamespace(saved_tensors=(row_of_slot_N,), T=T, K=top_k)
        return _GatherTriton.backward(ctx, grad_RD)[0]
    ctx = SimpleNamespace(saved_tensors=(row_of_slot_N,), K=top_k)
    return (reference._GatherSorted if exact else _GatherRows).backward(ctx, grad_RD)[0]


@gather_backward.register_fake
def _(grad_RD, slot_of_row_R, row_of_slot_N, top_k, exact, backend):
    return grad_RD.new_empty((row_of_slot_N.shape[0] // top_k, grad_RD.shape[1]))


def _gather_setup(ctx, inputs, output) -> None:
    h_TD, slot_of_row_R, row_of_slot_N, *cfg = inputs
    ctx.save_for_backward(slot_of_row_R, row_of_slot_N)
    ctx.cfg = cfg


def _gather_backward(ctx, grad_RD):
    slot_of_row_R, row_of_slot_N = ctx.saved_tensors
    return gather_backward(grad_RD, slot_of_row_R, row_of_slot_N, *ctx.cfg), None, None, None, None, None


gather.register_autograd(_gather_backward, setup_context=_gather_setup)

# ---------------------------------------------------------------------------------------------------------------
# combine: y [R, D], w [T, K] -> [T, D]


@custom_op("moestack::moe_combine", mutates_args=())
def combine(y_RD: torch.Tensor, topk_w_TK: torch.Tensor, slot_of_row_R: torch.Tensor, row_of_slot_N: torch.Tensor,
            exact: bool, backend: str | None) -> torch.Tensor:
    from moestack.ops.moe.routing import _combine_impl

    with torch.no_grad():
        return _combine_impl(y_RD, topk_w_TK, slot_of_row_R, row_of_slot_N, exact, backend)


@combine.register_fake
def _(y_RD, topk_w_TK, slot_of_row_R, row_of_slot_N, exact, backend):
    return y_RD.new_empty((topk_w_TK.shape[0], y_RD.shape[1]))


@custom_op("moestack::moe_combine_backward", mutates_args=())
def combine_backward(grad_TD: torch.Tensor, y_RD: torch.Tensor, topk_w_TK: torch.Tensor, slot_of_row_R: torch.Tensor,
                     row_of_slot_N: torch.Tensor, exact: bool,
                     backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    from moestack.ops.moe.routing import _combine_impl, resolve_backend

    if resolve_backend(backend, y_RD.device) == "triton":
        from moestack.ops.moe.triton_permute import _CombineTriton

        ctx = SimpleNamespace(saved_tensors=(y_RD.contiguous(), topk_w_TK.contiguous(), slot_of_row_R,
                                             row_of_slot_N), exact=exact)
        dy, dw = _CombineTriton.backward(ctx, grad_TD)[:2]
        return dy, dw

    def fwd(y, w):
        return _combine_impl(y, w, slot_of_row_R, row_of_slot_N, exact, backend)

    dy, dw = _vjp(fwd, (y_RD, topk_w_TK), grad_TD)
    return dy.contiguous(), dw.contiguous()


@combine_backward.register_fake
def _(grad_TD, y_RD, topk_w_TK, slot_of_row_R, row_of_slot_N, exact, backend):
    return (torch.empty_like(y_RD, memory_format=torch.contiguous_format),
            torch.empty_like(topk_w_TK, memory_format=torch.contiguous_format))


def _combine_setup(ctx, inputs, output) -> None:
    y_RD, topk_w_TK, slot_of_row_R, row_of_slot_N, *cfg = inputs
    ctx.save_for_backward(y_RD, topk_w_TK, slot_of_row_R, row_of_slot_N)
    ctx.cfg = cfg


def _combine_backward(ctx, grad_TD):
    dy, dw = combine_backward(grad_TD, *ctx.saved_tensors, *ctx.cfg)
    return dy, dw, None, None, None, None


combine.register_autograd(_combine_backward, setup_context=_combine_setup)

# ---------------------------------------------------------------------------------------------------------------
# grouped GEMM: x [N, D], w [E, D, F] (of one dtype: the entry casts) -> [N, F]


def _table(crossover_rows: int | None):
    """The crossover table the entry was given, as its threshold for this GEMM shape (None: the built-in one)."""
    if crossover_rows is None:
        return None
    from moestack.ops.moe.gemm_select import CrossoverTable

    return CrossoverTable(crossover_rows, {})


def _gemm_kernel(x_ND: torch.Tensor, w_EDF: torch.Tensor, backend: str | None, crossover_rows: int | None) -> str:
    """What grouped_mm runs for these operands: "triton" (TritonGroupedMM), "native" (torch's grouped GEMM), or
    the backend's name for the others (torch's fallbacks, the reference loop, a registered extra)."""
    from moestack.ops import tuned
    from moestack.ops.moe import REGISTRY, reference

    name = REGISTRY.pick(backend, x_ND, lambda: tuned.grouped_mm_key(x_ND, w_EDF)).name
    if name == "crossover":  # gemm_select.grouped_mm_auto's branch
        from moestack.ops.moe.gemm_select import choose

        small = choose(x_ND.shape[0], *w_EDF.shape, _table(crossover_rows)) == "triton"
        name = "triton" if small and x_ND.is_cuda and x_ND.dtype in (torch.bfloat16, torch.float16) else "torch"
    if name == "torch" and reference.native_grouped_mm_supported(x_ND, w_EDF):
        return "native"
    return name


@custom_op("moestack::moe_grouped_mm", mutates_args=())
def grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, backend: str | None,
               crossover_rows: int | None) -> torch.Tensor:
    from moestack.ops.moe import _grouped_mm_impl

    with torch.no_grad(), torch.autocast(x_ND.device.type, enabled=False):
        return _grouped_mm_impl(x_ND, w_EDF, offs_E, backend, _table(crossover_rows))


@grouped_mm.register_fake
def _(x_ND, w_EDF, offs_E, backend, crossover_rows):
    return x_ND.new_empty((x_ND.shape[0], w_EDF.shape[2]), dtype=torch.promote_types(x_ND.dtype, w_EDF.dtype))


def _empty_dw_like(w_EDF: torch.Tensor) -> torch.Tensor:
    """dW's layout: w's when w is the transposed view of a contiguous [E, F, D] (what Experts passes; the Triton
    weight gradient writes it so), else contiguous (triton_grouped_gemm.empty_grad_like)."""
    E, D, F = w_EDF.shape
    if w_EDF.transpose(1, 2).is_contiguous():
        return w_EDF.new_empty((E, F, D)).transpose(1, 2)
    return w_EDF.new_empty((E, D, F))


def _in_layout(dw: torch.Tensor, w_EDF: torch.Tensor) -> torch.Tensor:
    out = _empty_dw_like(w_EDF)
    return dw if dw.stride() == out.stride() or dw.numel() == 0 else out.copy_(dw)


def _native_dw(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, dy_NF: torch.Tensor) -> torch.Tensor:
    """dW from torch's grouped GEMM, written in w's layout: for the transposed view of an [E, F, D] weight (what
    Experts passes) as dW^T[e] = dY^T x, so no strided copy of the whole expert gradient follows (the H200's
    K3 slice: a 4 ms copy per expert weight and micro-batch, 97 ms of a 659 ms step, RESULTS.md)."""
    from moestack.ops.moe import reference

    if w_EDF.transpose(1, 2).is_contiguous():
        return reference.grouped_mm_native(dy_NF.t(), x_ND, offs_E).transpose(1, 2)
    return reference.grouped_mm_native(x_ND.t(), dy_NF, offs_E)


@custom_op("moestack::moe_grouped_mm_backward", mutates_args=())
def grouped_mm_backward(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, dy_NF: torch.Tensor,
                        backend: str | None, crossover_rows: int | None, need_dx: bool,
                        need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from moestack.ops.moe import _grouped_mm_impl, reference

    with torch.autocast(x_ND.device.type, enabled=False):
        kernel = _gemm_kernel(x_ND, w_EDF, backend, crossover_rows)
        if kernel == "triton":
            from moestack.ops.moe.triton_grouped_gemm import TritonGroupedMM

            ctx = SimpleNamespace(saved_tensors=(x_ND, w_EDF, offs_E.contiguous()),
                                  needs_input_grad=(need_dx, need_dw, False))
            dx, dw, _ = TritonGroupedMM.backward(ctx, dy_NF)
        elif kernel == "native":  # dX = dY w^T per expert, dW[e] = x[rows of e]^T dY[rows of e]
            dy_NF = dy_NF.to(x_ND.dtype)
            dx = reference.grouped_mm_native(dy_NF, w_EDF.transpose(1, 2), offs_E) if need_dx else None
            dw = _native_dw(x_ND, w_EDF, offs_E, dy_NF) if need_dw else None
        else:
            def fwd(x, w):
                return _grouped_mm_impl(x, w, offs_E, backend, _table(crossover_rows))

            dx, dw = _vjp(fwd, (x_ND, w_EDF), dy_NF)
    dx = x_ND.new_empty(0) if not need_dx else dx.contiguous()
    dw = w_EDF.new_empty(0) if not need_dw else _in_layout(dw, w_EDF)
    return dx, dw


@grouped_mm_backward.register_fake
def _(x_ND, w_EDF, offs_E, dy_NF, backend, crossover_rows, need_dx, need_dw):
    return (torch.empty_like(x_ND, memory_format=torch.contiguous_format) if need_dx else x_ND.new_empty(0),
            _empty_dw_like(w_EDF) if need_dw else w_EDF.new_empty(0))


def _gemm_setup(ctx, inputs, output) -> None:
    x_ND, w_EDF, offs_E, *cfg = inputs
    ctx.save_for_backward(x_ND, w_EDF, offs_E)
    ctx.cfg = cfg


def _gemm_backward(ctx, dy_NF):
    x_ND, w_EDF, offs_E = ctx.saved_tensors
    dx, dw = grouped_mm_backward(x_ND, w_EDF, offs_E, dy_NF, *ctx.cfg, *ctx.needs_input_grad[:2])
    return _none_if_empty(dx), _none_if_empty(dw), None, None, None


grouped_mm.register_autograd(_gemm_backward, setup_context=_gemm_setup)
