"""MoE reference ops, pure torch: routing, sort-based permutation, grouped GEMM, weighted combine.

This file is the spec of the MoE token path (README.md beside it has the derivations and the determinism
argument). `route`, `permute`, `unpermute_combine` are vectorised and used as-is by the model; `grouped_mm`
is the torch backend of the hot op (the native grouped GEMM where it works, else a padded-bmm or per-expert
fallback); `grouped_mm_loop` and `moe_loop_reference` are the loop-clear ground truths for tests.

Legend:
    T tokens, E experts, K experts per token (top-k), N = T*K routed rows, G expert groups, S = E // G,
    D width of the expert input/output (the hidden, or the latent of a LatentMoE), I expert intermediate size,
    F output width of one grouped GEMM, C padded rows per expert.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

# Public since torch 2.10 as F.grouped_mm; torch._grouped_mm before.
_NATIVE_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

SCORES = ("sigmoid", "softmax")


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _topk_lowest_index_on_ties(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim; among equal values the lower index wins.

    A stable descending sort makes the tie rule explicit and identical on every device (torch.topk leaves it
    unspecified). The sort is over E (or G) entries per token, small next to the expert GEMMs.
    """
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An avalanche hash of uint32 values held in int64 (xor-shift-multiply rounds). The multipliers are below
    2^31, so every product of a 32-bit value stays inside int64 and is exact on every device."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def selection_jitter(num_tokens: int, num_experts: int, seed: torch.Tensor | int, amplitude: float,
                     device: torch.device | None = None) -> torch.Tensor:
    """eps * U[0, 1) per (token, expert), fp32 [T, E]: a noise added to the scores that choose experts, never to
    the routing weights (RouterSpec.selection_jitter). A hash of (t * E + e, seed), not RNG state, so a
    recompute or a resumed run draws the same values, CPU and CUDA agree bit for bit, and compiled graphs trace
    it. Why: a per-expert bias cannot split tokens whose scores are (near) equal; the jitter makes them distinct
    by up to eps, so the quantile bias can split them (benchmarks/RESULTS.md, "Expert balance").
    seed: an int64 scalar (tensor or int; the trainer sets one per router and optimizer step)."""
    device = seed.device if isinstance(seed, torch.Tensor) and device is None else device
    key_TE = torch.arange(num_tokens * num_experts, dtype=torch.int64, device=device).view(num_tokens, num_experts)
    seed_mix = _mix32(torch.as_tensor(seed, dtype=torch.int64, device=device) & _MASK32)
    bits_TE = _mix32(_mix32(key_TE & _MASK32) ^ seed_mix)
    return (bits_TE >> 8).to(torch.float32).mul_(amplitude * 2.0**-24)


def route(
    logits_TE: torch.Tensor,
    bias_E: torch.Tensor | None,
    top_k: int,
    score: str = "sigmoid",
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-choice top-k routing (DeepSeek-V3 / Kimi K3; softmax scores for Mixtral / Qwen3 style).

    Args:
        logits_TE: router logits [T, E]; math runs in at least fp32.
        bias_E: selection bias added for the choice only, or None: [E] (aux-loss-free balancing), or [T, E]
            (that bias plus a per-token selection_jitter).
        top_k: experts per token.
        score: "sigmoid" (s = sigmoid(logits)) or "softmax" (s = softmax over experts).
        num_groups, topk_groups: group-limited routing. Experts split into num_groups contiguous groups; a
            group's score is the sum of its top-2 (s + bias) (its max if a group has one expert); only the best
            topk_groups groups are eligible.
        renormalize: divide the chosen weights by their sum.
        scaling: multiply the weights by this (routed_scaling_factor).
    Returns:
        topk_idx_TK int64 (ordered by descending s + bias; ties -> lower expert id first),
        topk_w_TK (the unbiased s at the chosen ids, renormalised, scaled; differentiable w.r.t. logits),
        scores_TE (s; differentiable), both in at least fp32.
    """
    T, E = logits_TE.shape
    logits = logits_TE.to(_at_least_fp32(logits_TE.dtype))
    if score == "sigmoid":
        scores_TE = torch.sigmoid(logits)
    elif score == "softmax":
        scores_TE = torch.softmax(logits, dim=-1)
    else:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")

    choice_TE = scores_TE.detach()
    if bias_E is not None:
        choice_TE = choice_TE + bias_E.to(choice_TE.dtype)
    if num_groups > 1:
        assert E % num_groups == 0 and topk_groups <= num_groups
        S = E // num_groups
        choice_TGS = choice_TE.view(T, num_groups, S)
        group_score_TG = choice_TGS.topk(min(2, S), dim=-1).values.sum(-1)
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
        keep_TG.scatter_(1, _topk_lowest_index_on_ties(group_score_TG, topk_groups), True)
        choice_TE = choice_TGS.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, E)

    topk_idx_TK = _topk_lowest_index_on_ties(choice_TE, top_k)
    topk_w_TK = scores_TE.gather(1, topk_idx_TK)
    if renormalize:
        topk_w_TK = topk_w_TK / topk_w_TK.sum(-1, keepdim=True).clamp_min(1e-20)
    if scaling != 1.0:
        topk_w_TK = topk_w_TK * scaling
    return topk_idx_TK, topk_w_TK, scores_TE


class Permutation(NamedTuple):
    """The sort of the N = T*K (token, slot) pairs by expert. All on the device of topk_idx; no host sync."""

    order_N: torch.Tensor  # int64: flat (token*K + slot) position of each sorted row (stable: token order kept)
    inverse_N: torch.Tensor  # int64: sorted row of each flat (token, slot) position; inverse of order_N
    token_ids_N: torch.Tensor  # int64: the token each sorted row reads (order_N // K)
    counts_E: torch.Tensor  # int64: rows per expert
    offs_E: torch.Tensor  # int32: cumulative row ends per expert (grouped_mm's offs); offs_E[-1] == N


def permute(topk_idx_TK: torch.Tensor, num_experts: int) -> Permutation:
    """Sort the routed (token, slot) pairs by expert with one stable sort; no loop over experts, no host sync.

    Gather the expert inputs with h_TD[perm.token_ids_N] -> h_sorted [N, D]; rows of expert e are
    offs_E[e-1]:offs_E[e], in token order.
    """
    T, K = topk_idx_TK.shape
    flat_N = topk_idx_TK.reshape(-1)
    expert_sorted_N, order_N = torch.sort(flat_N, stable=True)
    arange_N = torch.arange(flat_N.numel(), device=flat_N.device)
    inverse_N = torch.empty_like(order_N).scatter_(0, order_N, arange_N)
    experts_E = torch.arange(num_experts, device=flat_N.device, dtype=expert_sorted_N.dtype)
    ends_E = torch.searchsorted(expert_sorted_N, experts_E, right=True)
    counts_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    return Permutation(order_N, inverse_N, order_N // K, counts_E, ends_E.to(torch.int32))


class _GatherSorted(torch.autograd.Function):
    """h_sorted = h_TD[token_ids]; backward sums each token's K slot gradients in a fixed order.

    Autograd's own backward of an index gather is an accumulating scatter (index_put with duplicates), which is
    run-to-run non-deterministic on CPU threads and with CUDA atomics; here each token's K rows are gathered back
    through the inverse permutation and summed, so the result is bitwise reproducible.
    """

    @staticmethod
    def forward(ctx, h_TD: torch.Tensor, token_ids_N: torch.Tensor, inverse_N: torch.Tensor, K: int):
        ctx.save_for_backward(inverse_N)
        ctx.K = K
        return h_TD[token_ids_N]

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        (inverse_N,) = ctx.saved_tensors
        N, D = grad_ND.shape
        grad_TKD = grad_ND[inverse_N].view(N // ctx.K, ctx.K, D)
        grad_TD = grad_TKD.sum(1, dtype=_at_least_fp32(grad_ND.dtype)).to(grad_ND.dtype)
        return grad_TD, None, None, None


def gather_sorted(h_TD: torch.Tensor, perm: Permutation, K: int) -> torch.Tensor:
    """Expert-major copy of the routed inputs, [T*K, D]: rows of expert e at offs_E[e-1]:offs_E[e].
    Deterministic in forward and backward (see _GatherSorted)."""
    return _GatherSorted.apply(h_TD, perm.token_ids_N, perm.inverse_N, K)


def unpermute_combine(y_sorted_ND: torch.Tensor, perm: Permutation, topk_w_TK: torch.Tensor) -> torch.Tensor:
    """y_TD[t] = sum_k topk_w_TK[t, k] * (expert output of slot (t, k)). Returns [T, D] in y_sorted's dtype.

    Deterministic on every device: the rows go back to (token, slot) order by a gather (a permutation, no
    atomics) and the K slots are summed in a fixed order, in at least fp32. (index_add / scatter_add would be
    atomic, run-to-run non-deterministic on CUDA.)
    """
    T, K = topk_w_TK.shape
    N, D = y_sorted_ND.shape
    assert N == T * K, f"y_sorted has {N} rows, expected T*K = {T * K}"
    dtype = _at_least_fp32(torch.promote_types(y_sorted_ND.dtype, topk_w_TK.dtype))
    y_TKD = y_sorted_ND[perm.inverse_N].view(T, K, D)
    y_TD = (y_TKD.to(dtype) * topk_w_TK.to(dtype).unsqueeze(-1)).sum(1)
    return y_TD.to(y_sorted_ND.dtype)


# ---------------------------------------------------------------------------------------------------------------
# grouped GEMM: out[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e]


def _compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The autocast dtype inside an autocast region of x's device type, else the promoted input dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, w.dtype)


def _aligned16(t: torch.Tensor) -> bool:
    """Base pointer and every non-unit stride 16-byte aligned, with one unit stride among the last two dims."""
    size = t.element_size()
    if t.data_ptr() % 16:
        return False
    if 1 not in (t.stride(-1), t.stride(-2)):
        return False
    return all((s * size) % 16 == 0 for s in t.stride() if s != 1)


def native_grouped_mm_supported(x_ND: torch.Tensor, w_EDF: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM (forward and backward) runs on these operands: CUDA sm80+, bf16, 16-byte
    aligned base pointers and strides. On CPU (torch 2.13) the fp32 forward runs but its backward raises, so
    CPU always takes a fallback."""
    if _NATIVE_GROUPED_MM is None or not x_ND.is_cuda:
        return False
    if x_ND.dtype != torch.bfloat16 or w_EDF.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x_ND.device) < (8, 0):
        return False
    return x_ND.stride(-1) == 1 and _aligned16(x_ND) and _aligned16(w_EDF)


def grouped_mm_native(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM as is (no checks, no casts). Rows from offs_E[-1] on are left unwritten."""
    return _NATIVE_GROUPED_MM(x_ND, w_EDF, offs=offs_E)


def grouped_mm_loop(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """The ground truth: one matmul per non-empty expert. Reads offs on the host (one sync). Rows from
    offs_E[-1] on are zero. Differentiable in x and w."""
    N, F = x_ND.shape[0], w_EDF.shape[-1]
    pieces, start = [], 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            pieces.append(x_ND[start:end] @ w_EDF[e])
        start = end
    dtype = pieces[0].dtype if pieces else _compute_dtype(x_ND, w_EDF)
    pieces.append(x_ND.new_zeros((N - start, F), dtype=dtype))
    return torch.cat(pieces)


def grouped_mm_padded(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, cap: int) -> torch.Tensor:
    """Scatter each expert's rows into a zero-padded [E, cap, D] block, one bmm, gather back. cap must be >= the
    largest group. No host sync itself; rows from offs_E[-1] on are zero. Differentiable in x and w."""
    N, D = x_ND.shape
    E, _, F = w_EDF.shape
    ends_E = offs_E.long()
    starts_E = ends_E - torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    rows_N = torch.arange(N, device=x_ND.device)
    # expert of each row; rows at/after offs[-1] get E (a dummy slot dropped below)
    expert_N = torch.searchsorted(ends_E, rows_N, right=True)
    valid_N = expert_N < E
    expert_N = expert_N.clamp_max(E - 1)
    pos_N = (rows_N - starts_E[expert_N]).clamp(0, max(cap - 1, 0))
    slot_N = torch.where(valid_N, expert_N * cap + pos_N, E * cap)  # flat slot in [E*cap + 1] (last = dummy)
    x_SD = x_ND.new_zeros((E * cap + 1, D)).index_copy(0, slot_N, x_ND)
    y_ECF = torch.bmm(x_SD[: E * cap].view(E, cap, D), w_EDF)
    y_SF = torch.cat([y_ECF.reshape(E * cap, F), y_ECF.new_zeros((1, F))])
    return y_SF[slot_N]


def grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM, the torch backend: out[rows of e] = x[rows of e] @ w[e] for each expert e.

    Args:
        x_ND: [N, D] rows sorted by expert (see `permute`).
        w_EDF: [E, D, F] per-expert weights; any strides (a transposed view of an [E, F, D] parameter is the
            layout grouped GEMM kernels prefer).
        offs_E: int32 [E] cumulative row ends; offs_E[-1] <= N; empty groups allowed.
    Returns:
        [N, F] in the autocast dtype inside autocast, else the promoted input dtype. Rows from offs_E[-1] on are
        unspecified (zero in the fallbacks, unwritten by the native kernel): callers must not read them.

    Path: torch's native grouped GEMM where `native_grouped_mm_supported` (no host sync); otherwise a padded bmm,
    or a per-expert loop when padding would more than double the work (extreme skew). Both fallbacks read the
    largest group size on the host: one device-to-host sync per call.
    """
    assert offs_E.dtype == torch.int32 and offs_E.numel() == w_EDF.shape[0], "offs must be int32 [E]"
    assert x_ND.shape[-1] == w_EDF.shape[-2], f"x width {x_ND.shape[-1]} != w in-dim {w_EDF.shape[-2]}"
    dtype = _compute_dtype(x_ND, w_EDF)
    x_ND, w_EDF = x_ND.to(dtype), w_EDF.to(dtype)
    if native_grouped_mm_supported(x_ND, w_EDF):
        return grouped_mm_native(x_ND, w_EDF, offs_E)
    E = w_EDF.shape[0]
    counts_E = torch.diff(offs_E.long(), prepend=offs_E.new_zeros(1, dtype=torch.long))
    if is_fake(offs_E):  # a dry run (moestack/train/dry_run.py): no counts to read, assume balanced routing
        cap, used = -(-x_ND.shape[0] // E), x_ND.shape[0]
    else:
        cap, used = torch.stack([counts_E.max(), offs_E[-1].long()]).tolist()  # the one host sync
    if E * cap <= 2 * used + E:
        return grouped_mm_padded(x_ND, w_EDF, offs_E, cap)
    return grouped_mm_loop(x_ND, w_EDF, offs_E)


# ---------------------------------------------------------------------------------------------------------------
# the whole routed-expert computation, loop-clear


def moe_loop_reference(
    h_TD: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    topk_w_TK: torch.Tensor,
    w_gate_up_E2ID: torch.Tensor,
    w_down_EDI: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """y_TD[t] = sum_k topk_w[t,k] * expert_{topk_idx[t,k]}(h[t]), one plain loop over experts.

    expert_e(h) = act(h W_g^T, h W_u^T) W_d^T with [W_g; W_u] = w_gate_up_E2ID[e] ([2I, D], gate rows first,
    nn.Linear's (out, in) layout) and W_d = w_down_EDI[e] ([D, I]). Computed in h's dtype; returns [T, D].
    """
    T, D = h_TD.shape
    y_TD = h_TD.new_zeros((T, D))
    for e in range(w_gate_up_E2ID.shape[0]):
        tok, slot = (topk_idx_TK == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate, up = (h_TD[tok] @ w_gate_up_E2ID[e].T).chunk(2, dim=-1)
        out = act(gate, up) @ w_down_EDI[e].T
        y_TD = y_TD.index_add(0, tok, out * topk_w_TK[tok, slot].unsqueeze(-1).to(out.dtype))
    return y_TD


def quantile_balancing_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Quantile balancing (Kimi K3, Sec. 2.3.3 and App. D), exact: the next selection bias [E] from one batch.

    Token t picks expert j when s_tj + b_j beats the token's cutoff a_tj, the k-th largest s_t + b among the other
    experts (the (k+1)-th overall for an expert in the token's top k, the k-th for one outside): j would be chosen
    with any bias above r_tj = a_tj - s_tj, the other biases held. The balanced bias of expert j admits exactly
    q = T*k/E tokens (rounded, 1 <= q < T), i.e. lies between the q-th and (q+1)-th smallest r_tj; this returns the
    midpoint, shifted so the biases have mean 0 (a common shift changes no choice). One coordinate step of the
    dual of the balanced-assignment problem: the cutoffs are those of the current bias. Ties in the choice
    follow the router's rule (lower id first); the result does not depend on it. Math in at least fp32.
    Args: scores_TE [T, E] router scores (sigmoid or softmax), bias_E [E] current selection bias.
    """
    T, E = scores_TE.shape
    assert 0 < top_k < E and T >= 2
    dtype = _at_least_fp32(scores_TE.dtype)
    s_TE = scores_TE.detach().to(dtype)
    choice_TE = s_TE + bias_E.to(dtype)
    sorted_TE = torch.sort(choice_TE, dim=-1, descending=True).values
    inside_TE = choice_TE >= sorted_TE[:, top_k - 1:top_k]  # j in the token's top k: the next one is its cutoff
    cutoff_TE = torch.where(inside_TE, sorted_TE[:, top_k:top_k + 1], sorted_TE[:, top_k - 1:top_k])
    r_sorted_TE = torch.sort(cutoff_TE - s_TE, dim=0).values
    q = min(max(round(T * top_k / E), 1), T - 1)
    b_E = 0.5 * (r_sorted_TE[q - 1] + r_sorted_TE[q])
    return b_E - b_E.mean()
