"""Fused Triton router: fp32 logits -> scores -> (+ bias) -> group-limited top-k -> weights, plus expert counts.

One program owns BT tokens and all E experts (E padded to BE, a power of two). Forward per token: scores
(sigmoid, or softmax over E), choice = scores + bias (per expert [E], or per token and expert [T, E]), group
scores (sum of the top-2 choices per group, the max for one-expert groups), the top `topk_groups` groups stay
eligible, then K rounds of "largest choice, lowest index among equals" (reference.route's tie rule), weights =
unbiased scores at the chosen ids, renormalised and scaled. Slot counts per expert come out of the same pass
(integer atomics: exact in any order).

Backward (grads to logits only; the choice has none, the bias none): G = dL/ds from the scores output plus, at
the chosen ids, the weights' path
    renormalise:  w_k = c s_k / S, S = sum_j s_{idx_j}:   dL/ds_k = (c g_k - sum_j g_j w_j) / S
    otherwise:    dL/ds_k = c g_k
then through the score function: sigmoid s(1-s) G; softmax s (G - <G, s>).

Legend: T tokens, E experts (BE padded), K top-k (KP padded), G groups of S experts (BG padded).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _block_tokens(BE: int) -> int:
    """Tokens per program: keep a [BT, BE] fp32 tile at ~4K elements."""
    return max(1, min(16, 4096 // BE))


@triton.jit
def router_fwd_kernel(
    logits_ptr, bias_ptr, scores_ptr, idx_ptr, w_ptr, counts_ptr, T, E, S, scaling,
    K: tl.constexpr, KP: tl.constexpr, G: tl.constexpr, TOPK_G: tl.constexpr, BG: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_2D: tl.constexpr, RENORM: tl.constexpr,
    TOP2: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_e = tl.arange(0, BE)
    o_k = tl.arange(0, KP)
    m_t, m_e = o_t < T, o_e < E
    m_te = m_t[:, None] & m_e[None, :]
    p_te = o_t.to(tl.int64)[:, None] * E + o_e[None, :]
    b_x = tl.load(logits_ptr + p_te, mask=m_te, other=float("-inf"))  # [BT, BE]
    if SOFTMAX:
        b_m = tl.max(b_x, axis=1)
        b_m = tl.where(m_t, b_m, 0.0)  # rows past T are all -inf
        b_ex = tl.where(m_te, tl.exp(b_x - b_m[:, None]), 0.0)
        b_den = tl.sum(b_ex, axis=1)
        b_s = b_ex / tl.where(b_den > 0, b_den, 1.0)[:, None]
    else:
        b_s = 1.0 / (1.0 + tl.exp(-b_x))
    b_s = tl.where(m_te, b_s, 0.0)
    tl.store(scores_ptr + p_te, b_s, mask=m_te)

    b_c = b_s
    if HAS_BIAS:
        if BIAS_2D:  # the bias plus a per-token selection jitter, [T, E]
            b_c = b_c + tl.load(bias_ptr + p_te, mask=m_te, other=0.0)
        else:
            b_c = b_c + tl.load(bias_ptr + o_e, mask=m_e, other=0.0)[None, :]
    b_c = tl.where(m_e[None, :], b_c, float("-inf"))
    if G > 1:
        grp = o_e // S  # [BE]
        o_g = tl.arange(0, BG)
        b_gs = tl.full([BT, BG], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(G):
            b_cg = tl.where((grp == g)[None, :] & m_e[None, :], b_c, float("-inf"))
            b_m1 = tl.max(b_cg, axis=1)
            b_score = b_m1
            if TOP2:
                b_i1 = tl.min(tl.where(b_cg == b_m1[:, None], o_e[None, :], BE), axis=1)
                b_m2 = tl.max(tl.where(o_e[None, :] == b_i1[:, None], float("-inf"), b_cg), axis=1)
                b_score = b_m1 + b_m2
            b_gs = tl.where(o_g[None, :] == g, b_score[:, None], b_gs)
        b_gs = tl.where((o_g < G)[None, :], b_gs, float("-inf"))
        b_keep = tl.zeros([BT, BE], dtype=tl.int32)
        for j in tl.static_range(TOPK_G):
            b_mg = tl.max(b_gs, axis=1)
            b_ig = tl.min(tl.where(b_gs == b_mg[:, None], o_g[None, :], BG), axis=1)
            b_gs = tl.where(o_g[None, :] == b_ig[:, None], float("-inf"), b_gs)
            b_keep = b_keep | (grp[None, :] == b_ig[:, None]).to(tl.int32)
        b_c = tl.where(b_keep > 0, b_c, float("-inf"))

    b_idx = tl.zeros([BT, KP], dtype=tl.int32)
    b_w = tl.zeros([BT, KP], dtype=tl.float32)
    b_sum = tl.zeros([BT], dtype=tl.float32)
    for k in tl.static_range(K):
        b_mk = tl.max(b_c, axis=1)
        b_ik = tl.min(tl.where(b_c == b_mk[:, None], o_e[None, :], BE), axis=1)  # lowest index among equals
        b_hit = o_e[None, :] == b_ik[:, None]
        b_sk = tl.sum(tl.where(b_hit, b_s, 0.0), axis=1)
        b_c = tl.where(b_hit, float("-inf"), b_c)
        b_idx = tl.where(o_k[None, :] == k, b_ik[:, None], b_idx)
        b_w = tl.where(o_k[None, :] == k, b_sk[:, None], b_w)
        b_sum += b_sk
        tl.atomic_add(counts_ptr + b_ik, 1, mask=m_t)
    if RENORM:
        b_w = b_w / tl.maximum(b_sum, 1e-20)[:, None]
    b_w = b_w * scaling
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    p_tk = o_t.to(tl.int64)[:, None] * K + o_k[None, :]
    tl.store(idx_ptr + p_tk, b_idx.to(tl.int64), mask=m_tk)
    tl.store(w_ptr + p_tk, b_w, mask=m_tk)


@triton.jit
def router_bwd_kernel(
    scores_ptr, idx_ptr, w_ptr, dw_ptr, ds_ptr, dlogits_ptr, T, E, scaling,
    K: tl.constexpr, KP: tl.constexpr, SOFTMAX: tl.constexpr, HAS_DS: tl.constexpr, RENORM: tl.constexpr,
    BT: tl.constexpr, BE: tl.constexpr,
):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_e = tl.arange(0, BE)
    o_k = tl.arange(0, KP)
    m_t, m_e = o_t < T, o_e < E
    m_te = m_t[:, None] & m_e[None, :]
    p_te = o_t.to(tl.int64)[:, None] * E + o_e[None, :]
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    p_tk = o_t.to(tl.int64)[:, None] * K + o_k[None, :]
    b_s = tl.load(scores_ptr + p_te, mask=m_te, other=0.0)  # [BT, BE]
    b_idx = tl.load(idx_ptr + p_tk, mask=m_tk, other=-1).to(tl.int32)  # [BT, KP]
    b_g = tl.load(dw_ptr + p_tk, mask=m_tk, other=0.0)
    if HAS_DS:
        b_G = tl.load(ds_ptr + p_te, mask=m_te, other=0.0)
    else:
        b_G = tl.zeros([BT, BE], dtype=tl.float32)
    if RENORM:
        b_w = tl.load(w_ptr + p_tk, mask=m_tk, other=0.0)
        b_sum = tl.zeros([BT], dtype=tl.float32)
        for k in tl.static_range(K):
            b_ik = tl.sum(tl.where(o_k[None, :] == k, b_idx, 0), axis=1)
            b_sum += tl.sum(tl.where(o_e[None, :] == b_ik[:, None], b_s, 0.0), axis=1)
        b_dot = tl.where(b_sum >= 1e-20, tl.sum(b_g * b_w, axis=1), 0.0)  # the clamp passes no gradient
        b_dsk = (scaling * b_g - b_dot[:, None]) / tl.maximum(b_sum, 1e-20)[:, None]  # [BT, KP]
    else:
        b_dsk = scaling * b_g
    for k in tl.static_range(K):
        b_ik = tl.sum(tl.where(o_k[None, :] == k, b_idx, 0), axis=1)
        b_dk = tl.sum(tl.where(o_k[None, :] == k, b_dsk, 0.0), axis=1)
        b_G += tl.where(o_e[None, :] == b_ik[:, None], b_dk[:, None], 0.0)
    if SOFTMAX:
        b_dx = b_s * (b_G - tl.sum(b_G * b_s, axis=1)[:, None])
    else:
        b_dx = b_G * b_s * (1.0 - b_s)
    tl.store(dlogits_ptr + p_te, b_dx, mask=m_te)


class _RouteTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, bias_E, top_k, score, num_groups, topk_groups, renormalize, scaling):
        logits_TE = logits_TE.contiguous()
        T, E = logits_TE.shape
        dev = logits_TE.device
        BE = triton.next_power_of_2(E)
        BT = _block_tokens(BE)
        KP = triton.next_power_of_2(top_k)
        scores_TE = torch.empty((T, E), dtype=torch.float32, device=dev)
        idx_TK = torch.empty((T, top_k), dtype=torch.int64, device=dev)
        w_TK = torch.empty((T, top_k), dtype=torch.float32, device=dev)
        counts_E = torch.zeros(E, dtype=torch.int32, device=dev)
        bias = bias_E.to(torch.float32).contiguous() if bias_E is not None else scores_TE
        S = E // num_groups
        router_fwd_kernel[(triton.cdiv(T, BT),)](
            logits_TE, bias, scores_TE, idx_TK, w_TK, counts_E, T, E, S, float(scaling),
            K=top_k, KP=KP, G=num_groups, TOPK_G=topk_groups, BG=triton.next_power_of_2(num_groups),
            SOFTMAX=score == "softmax", HAS_BIAS=bias_E is not None,
            BIAS_2D=bias_E is not None and bias_E.dim() == 2, RENORM=renormalize, TOP2=S >= 2,
            BT=BT, BE=BE, num_warps=4,
        )
        ctx.save_for_backward(scores_TE, idx_TK, w_TK)
        ctx.cfg = (top_k, score == "softmax", renormalize, float(scaling), BT, BE, KP)
        ctx.mark_non_differentiable(idx_TK, counts_E)
        return idx_TK, w_TK, scores_TE, counts_E.to(torch.int64)

    @staticmethod
    def backward(ctx, _didx, dw_TK, dscores_TE, _dcounts):
        scores_TE, idx_TK, w_TK = ctx.saved_tensors
        K, softmax, renorm, scaling, BT, BE, KP = ctx.cfg
        T, E = scores_TE.shape
        dlogits_TE = torch.empty_like(scores_TE)
        dw = dw_TK.contiguous().float() if dw_TK is not None else torch.zeros_like(w_TK)
        ds = dscores_TE.contiguous().float() if dscores_TE is not None else scores_TE
        router_bwd_kernel[(triton.cdiv(T, BT),)](
            scores_TE, idx_TK, w_TK, dw, ds, dlogits_TE, T, E, scaling,
            K=K, KP=KP, SOFTMAX=softmax, HAS_DS=dscores_TE is not None, RENORM=renorm, BT=BT, BE=BE, num_warps=4,
        )
        return dlogits_TE, None, None, None, None, None, None, None


def route_triton(
    logits_TE: torch.Tensor,
    bias_E: torch.Tensor | None,
    top_k: int,
    score: str = "sigmoid",
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused routing.route: fp32 logits [T, E] -> (topk_idx int64 [T, K], topk_w fp32 [T, K], scores fp32 [T, E],
    counts int64 [E]). Same rule and tie order as reference.route; differentiable w.r.t. logits."""
    E = logits_TE.shape[1]
    if logits_TE.dtype != torch.float32:
        raise ValueError(f"logits_TE must be float32 for the Triton router, got {logits_TE.dtype}")
    if score not in ("sigmoid", "softmax"):
        raise ValueError(f"score must be 'sigmoid' or 'softmax', got {score!r}")
    if bias_E is not None and bias_E.shape not in ((E,), tuple(logits_TE.shape)):
        raise ValueError(f"bias_E must be [E] or [T, E] = {list(logits_TE.shape)}, got {list(bias_E.shape)}")
    if E % num_groups or not 1 <= topk_groups <= num_groups or top_k > topk_groups * (E // num_groups):
        raise ValueError(f"num_groups={num_groups}, topk_groups={topk_groups}, top_k={top_k} do not fit E={E}")
    return _RouteTriton.apply(logits_TE, bias_E, top_k, score, num_groups, topk_groups, renormalize, scaling)
