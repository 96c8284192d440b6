"""Quantile balancing (Kimi K3) from a histogram: accumulated on the device per micro-batch, summed over ranks,
solved once per optimizer step. reference.quantile_balancing_bias is the exact (sort-based) spec.

Per token t and expert j the required bias is r_tj = a_tj - s_tj, with a_tj the k-th largest s_t + b among the
other experts (the token's cutoff for j): expert j gets token t for any bias above r_tj. The balanced bias of j is
the k/E quantile of r_.j over the step's tokens (every token, every micro-batch, every data-parallel rank). Scores
lie in (0, 1), so r lies in (min b - 1, max b + 1): B uniform bins over that range (the report's App. D: 1000) hold
the counts, int32 [E, B] per layer, and the quantile is read with linear interpolation inside its bin. Histograms
add exactly, so micro-batches and ranks reduce with one integer sum, and the result is independent of how the step's
tokens were split. The range comes from the bias itself, which is the same on every rank and fixed
during the step.

Two scopes (RouterSpec.quantile_scope):
    "step"   (Kimi K3) the histogram of the whole optimizer step sets the bias the NEXT step routes with;
    "batch"  each micro-batch solves its own bias before routing (`batch_bias`): `iterations` coordinate steps
             from the current bias, each two histograms of this micro-batch over the balance group (one all-reduce
             of per-expert min / max, two of the counts): each expert's full range [min_t r_tj, max_t r_tj] in B
             bins, then the bin that holds the quantile in B finer ones, so the quantile resolves to range / B^2.
             One level is not enough for a router whose sigmoid scores sit near 0 or 1 (large logits): most of an
             expert's r_tj fall in one bin of its full range, and interpolating inside that bin moves whole
             groups of alike tokens at once. The step's mean solved bias becomes the router's bias
             (model.moe.Router): evaluation and inference route with it, and the next step's solves start
             from it, so the coordinate steps go on across steps while the router moves slowly. No lag behind the
             router, at the price of a bias that depends on the micro-batch's other tokens (no gradient flows
             through it).

Legend: T tokens, E experts, K top-k, B bins.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moestack.ops.graphed import GraphCache
from moestack.ops.moe import routing
from moestack.ops.opaque import opaque


def histogram_range(bias_E: torch.Tensor, num_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(low edge, bin width) per expert, fp32 [E] device tensors, for the current bias: [min b - 1, max b + 1] in B
    bins (the same range for every expert)."""
    b = bias_E.detach().float()
    lo = b.min() - 1.0
    width = (b.max() + 1.0 - lo) / num_bins
    return lo.expand_as(b), width.expand_as(b)


def required_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """r_TE = a_tj - s_tj (fp32): the bias above which token t picks expert j, the other biases held. a_tj is the
    k-th largest s_t + b among the other experts: the (k+1)-th overall for an expert in the token's top k, the k-th
    for one outside it."""
    s_TE = scores_TE.detach().float()
    choice_TE = s_TE + bias_E.detach().float()
    top_TK = choice_TE.topk(top_k + 1, dim=-1, sorted=True).values
    inside_TE = choice_TE >= top_TK[:, top_k - 1:top_k]
    return torch.where(inside_TE, top_TK[:, top_k:], top_TK[:, top_k - 1:top_k]) - s_TE


@torch.no_grad()
def accumulate_histogram_(hist_EB: torch.Tensor, scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int,
                          lo_E: torch.Tensor | None = None, width_E: torch.Tensor | None = None) -> torch.Tensor:
    """Add this batch's required-bias counts to hist_EB (int32 [E, B], in place; no host sync). Returns it.
    lo_E / width_E: per-expert bin range; default `histogram_range(bias_E, B)`."""
    if lo_E is None:
        lo_E, width_E = histogram_range(bias_E, hist_EB.shape[1])
    return _add_counts_(hist_EB, required_bias(scores_TE, bias_E, top_k), lo_E, width_E)


def _add_counts_(hist_EB: torch.Tensor, r_TE: torch.Tensor, lo_E: torch.Tensor, width_E: torch.Tensor,
                 offsets_E: torch.Tensor | None = None, ones_N: torch.Tensor | None = None) -> torch.Tensor:
    """hist_EB (int32 [E, B]) += the counts of r_TE in B bins from lo_E of width_E per expert (outside: the edge
    bins), in place. offsets_E = arange(E) * B and ones_N [T * E] of hist's dtype may be passed in (made once)."""
    E, B = hist_EB.shape
    if offsets_E is None:
        offsets_E = torch.arange(E, device=r_TE.device) * B
    if ones_N is None:
        ones_N = torch.ones(r_TE.numel(), dtype=hist_EB.dtype, device=r_TE.device)
    flat_TE = ((r_TE - lo_E) / width_E).floor_().clamp_(0, B - 1).to(torch.int64).add_(offsets_E)
    hist_EB.view(-1).scatter_add_(0, flat_TE.view(-1), ones_N)
    return hist_EB


@torch.no_grad()
def solve_histogram(hist_EB: torch.Tensor, bias_E: torch.Tensor, top_k: int, lo_E: torch.Tensor | None = None,
                    width_E: torch.Tensor | None = None) -> torch.Tensor:
    """The next bias [E] (fp32, mean 0) from a step's summed histogram; `bias_E` (the bias the histogram was
    taken under) where the histogram is empty. lo_E / width_E: the bins' range (default histogram_range). No host
    sync."""
    E, B = hist_EB.shape
    h_EB = hist_EB.long()
    cum_EB = h_EB.cumsum(-1)
    n_E = cum_EB[:, -1]
    target_E = n_E.double() * (top_k / E)
    # first bin whose cumulative count reaches the target, and the fraction of it below the target
    bin_E = (cum_EB.double() < target_E[:, None]).sum(-1).clamp_(max=B - 1)
    in_bin_E = h_EB.gather(1, bin_E[:, None]).squeeze(1)
    before_E = cum_EB.gather(1, bin_E[:, None]).squeeze(1) - in_bin_E
    frac_E = ((target_E - before_E.double()) / in_bin_E.clamp_min(1).double()).clamp_(0.0, 1.0)
    if lo_E is None:
        lo_E, width_E = histogram_range(bias_E, B)
    b_E = (lo_E.double() + (bin_E.double() + frac_E) * width_E.double())
    b_E = (b_E - b_E.mean()).float()
    return torch.where(n_E > 0, b_E, bias_E.detach().float())


def _bin_counts(r_TE: torch.Tensor, lo_E: torch.Tensor, width_E: torch.Tensor, offsets_E: torch.Tensor,
                ones_N: torch.Tensor, num_bins: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """int64 [E, B] cumulative counts of r_TE in B bins (`_add_counts_`), summed over `group`."""
    hist_EB = torch.zeros(r_TE.shape[1], num_bins, dtype=torch.int32, device=r_TE.device)
    _add_counts_(hist_EB, r_TE, lo_E, width_E, offsets_E, ones_N)
    if group is not None:
        dist.all_reduce(hist_EB, group=group)
    return hist_EB.cumsum(-1)


def batch_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, num_bins: int, iterations: int,
               group: dist.ProcessGroup | None = None, backend: str | None = None,
               momentum: float = 0.0) -> torch.Tensor:
    """The bias [E] (fp32, mean 0) that balances this micro-batch over `group` ("batch" scope, module docstring):
    `iterations` coordinate steps from bias_E, each reading the quantile in two passes (each expert's full range,
    then the bin that holds it), extrapolated by `momentum` (batch_bias_reference). Every rank of the group gets
    the same result; no host sync.
    backend: the routing backend (moestack.ops.moe.routing.resolve_backend; None = "triton" on CUDA): "triton"
    runs triton_quantile.batch_bias_triton (2 launches per step, 3 with momentum; the same counts), "reference"
    batch_bias_reference (the spec, ~50 aten ops per step)."""
    if routing.resolve_backend(backend, scores_TE.device) == "triton":
        from moestack.ops.moe.triton_quantile import batch_bias_triton

        return batch_bias_triton(scores_TE, bias_E, top_k, num_bins, iterations, group, momentum=momentum)
    return batch_bias_reference(scores_TE, bias_E, top_k, num_bins, iterations, group, momentum)


def extrapolate(y_E: torch.Tensor, y_prev_E: torch.Tensor, d_prev_E: torch.Tensor | None,
                momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the next step's start, this step's change d = y - y_prev): y + momentum * d (Nesterov-style, on the
    reads), except after a step that reversed the previous one's direction (d . d_prev <= 0: the extrapolation
    overshot, as it does on saturated scores), which starts from y alone. d_prev None: the first change, kept.
    Why: the coordinate steps contract a slow collective mode (many experts a little over, many a little under
    their share) by only ~3.5% a step on the proxy's routers; the extrapolation follows it (benchmarks/RESULTS.md,
    "Expert balance")."""
    d_E = y_E - y_prev_E
    if d_prev_E is None:
        return y_E + momentum * d_E, d_E
    keep = ((d_E * d_prev_E).sum() > 0).to(d_E.dtype)
    return y_E + (momentum * keep) * d_E, d_E


@torch.no_grad()
def batch_bias_reference(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, num_bins: int,
                         iterations: int, group: dist.ProcessGroup | None = None,
                         momentum: float = 0.0) -> torch.Tensor:
    """batch_bias in torch (the spec of the Triton path). Step n reads y_n from its start b_n; b_0 = bias_E,
    b_1 = y_0, later b_(n+1) = extrapolate(y_n, y_(n-1), ...) (momentum 0: b_(n+1) = y_n); the result is the last
    read. The loop is written for few launches: what does not change between steps is made once."""
    reduce = group is not None and dist.get_world_size(group) > 1
    group = group if reduce else None
    s_TE = scores_TE.detach().float()
    T, E = s_TE.shape
    b = bias_E.detach().float()
    offsets_E = torch.arange(E, device=s_TE.device) * num_bins
    ones_N = torch.ones(T * E, dtype=torch.int32, device=s_TE.device)
    n = torch.tensor([float(T)], dtype=torch.float64, device=s_TE.device)
    if reduce:  # tokens over the group: every expert's histogram counts each of them once
        dist.all_reduce(n, group=group)
    target = n * (top_k / E)  # [1] fp64: the q-th required bias per expert
    rows_E = torch.arange(E, device=s_TE.device)
    y_prev = d_prev = None
    for step in range(iterations):
        r_TE = required_bias(s_TE, b, top_k)
        ends_2E = torch.stack([r_TE.amin(0), r_TE.amax(0).neg_()])
        if reduce:
            dist.all_reduce(ends_2E, op=dist.ReduceOp.MIN, group=group)
        lo_E = ends_2E[0]
        width_E = (ends_2E[1].neg() - lo_E).mul_((1 + 1e-6) / num_bins).clamp_min_(1e-12)  # the max: last bin
        coarse_EB = _bin_counts(r_TE, lo_E, width_E, offsets_E, ones_N, num_bins, group)
        # the bin that holds the target count, then that bin alone in B finer bins (the tokens below it land in
        # the first fine bin, so the cumulative counts stay exact)
        at_E = (coarse_EB < target).sum(-1).clamp_(max=num_bins - 1)
        lo_E = lo_E + at_E * width_E
        width_E = (width_E / num_bins).clamp_min_(1e-12)
        cum_EB = _bin_counts(r_TE, lo_E, width_E, offsets_E, ones_N, num_bins, group)
        # the quantile: the first fine bin whose cumulative count reaches the target, interpolated inside it
        bin_E = (cum_EB < target).sum(-1).clamp_(max=num_bins - 1)
        upto_E = cum_EB[rows_E, bin_E]
        before_E = torch.where(bin_E > 0, cum_EB[rows_E, (bin_E - 1).clamp_(min=0)], 0)
        frac_E = ((target - before_E) / (upto_E - before_E).clamp_(min=1)).clamp_(0.0, 1.0)
        y = lo_E + (bin_E + frac_E.float()) * width_E
        y = y - y.mean()
        b = y
        if momentum > 0 and y_prev is not None and step < iterations - 1:
            b, d_prev = extrapolate(y, y_prev, d_prev, momentum)
        y_prev = y
    return y


def routed_max_load(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The most slots any expert gets when the batch routes by top-k of scores + bias: [...] for bias_E [..., E]
    (candidate biases stacked in front), summed over `group`. No host sync."""
    s_TE = scores_TE.detach().float()
    b_CE = bias_E.detach().float().reshape(-1, s_TE.shape[1])
    counts_CE = torch.zeros_like(b_CE, dtype=torch.int64)
    for c in range(b_CE.shape[0]):
        idx = (s_TE + b_CE[c]).topk(top_k, dim=-1).indices.reshape(-1)
        counts_CE[c].scatter_add_(0, idx, torch.ones_like(idx))
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts_CE, group=group)
    return counts_CE.amax(-1).reshape(bias_E.shape[:-1])


_SOLVE_GRAPHS = GraphCache()  # the captured solves, one per (choices, shapes): every MoE layer of a model shares one


def solve_batch_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, num_bins: int, iterations: int,
                     start: str = "best", group: dist.ProcessGroup | None = None,
                     backend: str | None = None, momentum: float = 0.0, graph: bool = False) -> torch.Tensor:
    """batch_bias from the start RouterSpec.quantile_start names: "bias" (warm: the router's bias, where the last
    step's solves ended), "zero", or "best" (both; the one whose routed max load over the group is lower, the
    warm one on a tie). Why both: where micro-batches differ (byte-level text: a window of indented code, then
    prose) the last step's bias can be a worse start than none, and the coordinate steps from far converge slowly
    (benchmarks/RESULTS.md, "Expert balance"); where they are alike, the warm start is the better one. momentum:
    RouterSpec.quantile_momentum (batch_bias_reference).
    graph (KernelSpec.moe.solve_graph): on CUDA with a single-rank group, replay the whole solve as one CUDA graph
    per shape (moestack/ops/graphed.py: bitwise the same bias; one replay instead of ~50 launches per call).
    Under torch.compile without a group: one custom op (moestack::solve_batch_bias), no graph break."""
    if start not in ("bias", "zero", "best"):
        raise ValueError(f"quantile_start must be 'bias', 'zero' or 'best', got {start!r}")
    if torch.compiler.is_compiling() and group is None:
        return solve_batch_bias_op(scores_TE.detach(), bias_E.detach(), top_k, num_bins, iterations, start, backend,
                                   momentum, graph)
    return _solve_batch_bias_eager(scores_TE, bias_E, top_k, num_bins, iterations, start, group, backend, momentum,
                                   graph)


@opaque  # with a group: a compiled block runs the solve eagerly (a collective inside)
@torch.no_grad()
def _solve_batch_bias_eager(scores_TE, bias_E, top_k, num_bins, iterations, start, group, backend, momentum, graph):
    if graph and (group is None or dist.get_world_size(group) == 1):
        choices = (top_k, num_bins, iterations, start, backend, momentum)
        return _SOLVE_GRAPHS(choices, lambda s, b: _solve(s, b, *choices, None), scores_TE.detach(), bias_E.detach())
    return _solve(scores_TE, bias_E, top_k, num_bins, iterations, start, backend, momentum, group)


@torch.library.custom_op("moestack::solve_batch_bias", mutates_args=())
def solve_batch_bias_op(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, num_bins: int, iterations: int,
                        start: str, backend: str | None, momentum: float, graph: bool) -> torch.Tensor:
    """The solve as one node of a compiled graph; inside a captured CUDA graph its kernels join that graph
    (GraphCache runs eagerly under a capture)."""
    return _solve_batch_bias_eager(scores_TE, bias_E, top_k, num_bins, iterations, start, None, backend, momentum,
                                   graph).clone()


@solve_batch_bias_op.register_fake
def _(scores_TE, bias_E, top_k, num_bins, iterations, start, backend, momentum, graph):
    return torch.empty_like(bias_E, dtype=torch.float32, memory_format=torch.contiguous_format)


def _solve(scores_TE, bias_E, top_k, num_bins, iterations, start, backend, momentum, group) -> torch.Tensor:
    zero_E = torch.zeros_like(bias_E, dtype=torch.float32)
    if start != "best":
        return batch_bias(scores_TE, bias_E if start == "bias" else zero_E, top_k, num_bins, iterations, group,
                          backend, momentum)
    warm_E = batch_bias(scores_TE, bias_E, top_k, num_bins, iterations, group, backend, momentum)
    cold_E = batch_bias(scores_TE, zero_E, top_k, num_bins, iterations, group, backend, momentum)
    load_2 = routed_max_load(scores_TE, torch.stack([warm_E, cold_E]), top_k, group)
    return torch.where(load_2[0] <= load_2[1], warm_E, cold_E)


__all__ = ["accumulate_histogram_", "batch_bias", "batch_bias_reference", "extrapolate", "histogram_range",
           "required_bias", "routed_max_load", "solve_batch_bias", "solve_histogram"]
