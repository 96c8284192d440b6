"""Block Attention Residuals (Kimi Team, "Attention Residuals", arXiv:2603.15031), exactly as Kimi K3 uses them.

Sources: the paper and the K3 technical report (arXiv:2607.24653, Sec. 2.2: "we partition its layers into 8 blocks
with 12-layer size, giving a partial final block and 9 total blocks when counting the embedding layer"); the
structure of the released modeling code (modeling_kimi_linear.py, as public ports transcribe it: a running
`prefix_sum`, a growing `block_residual` stack, `_apply_attn_res`) and the checkpoint's tensor names. Written here
from that math, not copied.

One mix (a learned softmax over depth replacing the residual sum). Per token, sources v_0 .. v_{n-1} [D]:

    k_i   = v_i / sqrt(mean(v_i^2) + eps)            RMSNorm of each source (keys = values, normalised, no weight)
    s_i   = w . k_i,   w = norm_weight * proj_weight  the learned pseudo-query [D] (stored as its two factors)
    a     = softmax_i(s)                              over the n sources, in fp32 (fp64 stays fp64)
    out   = sum_i a_i v_i                             (the un-normalised values), cast back to the sources' dtype

The query does not depend on the token's state; the RMSNorm keeps sources with large outputs from dominating.

The model (S = attn_res_block_size; blocks b_0 = embedding, b_1, ...; a block's representation is the SUM of its
layers' sub-layer outputs, the partial sum p of the running block):

    p = embed(tokens); B = []
    for layer l = 0 .. L-1:
        if l % S == 0: B = B + [p]; p = None             # the running block is complete (layer 0: the embedding)
        h = mix_attn(B + [p])  (B alone when p is None)  # per layer: its own pseudo-query before the mixer ...
        p = mixer(attn_norm(h)) (+ p)
        h = mix_ffn(B + [p])                             # ... and another before the FFN
        p = p + ffn(ffn_norm(h))
    logits = lm_head(norm(mix_out(B + [p])))             # the output mix reads every block, then the final norm

The pre-norms (attn_norm, ffn_norm) sit after the mix, as the plain model's sit on its residual stream; the
sub-layers' outputs are never normalised themselves. At layer 0 the mixer's mix has one source (the embedding)
and returns it exactly: the released code skips that call, which is the same value; here its two weights get an
exact zero gradient. K3 (93 layers, S 12): blocks close at layers 0, 12, .., 84; the output mix reads 8 completed
blocks and the partial block of layers 84..92 (9 sources); a layer's mixes read up to 9. Parameters: per layer 2
mixes x (norm_weight [D] + proj_weight [1, D]), plus the output mix: 93 x 4 x 7168 + 2 x 7168 = 2,680,832 in K3.
Checkpoint names: layers.{i}.self_attention_res_{norm,proj}.weight, layers.{i}.mlp_res_{norm,proj}.weight,
output_attn_res_{norm,proj}.weight (moestack/train/hf_names.py). Initialisation (paper): the pseudo-query is zero, so
every mix starts as the plain mean of its sources; norm weights 1. Eps: the model's norm eps.

Implementation: `attn_res_reference` is the spec (stacks the sources, plain autograd). `attn_res` is what the model
runs: an autograd.Function that never stacks. It keeps references to the sources (partial sums earlier layers
produced, alive anyway), the softmax weights, scores and per-source rstd [n, N] for backward: the stacked form
would save an n x [N, D] copy per mix, i.e. O(L^2 / S) activation memory over the depth. The op is token-local:
tensor / sequence / context parallelism leave it alone (its weights are replicated like a norm's); pipeline stages
pass B and p stacked [n + 1, B, T, D] (moestack.model.transformer). Not fused: it reads each source three times.

Legend: n sources, N tokens (any leading shape), D hidden, L layers.
"""

from __future__ import annotations

import torch
from torch import nn


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def attn_res_reference(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """The spec: sources n x [..., D] (same shape and dtype), norm_weight [D], proj_weight [1, D] -> [..., D]."""
    dtype = _compute_dtype(sources[0])
    v = torch.stack(sources).to(dtype)  # [n, ..., D]
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    w = norm_weight.to(dtype) * proj_weight.to(dtype).reshape(-1)
    alpha = (k * w).sum(-1).softmax(0)  # [n, ...]
    return (alpha.unsqueeze(-1) * v).sum(0).to(sources[0].dtype)


class _AttnRes(torch.autograd.Function):
    """attn_res: forward and backward by source, nothing stacked (module docstring)."""

    @staticmethod
    def forward(ctx, norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float, *sources: torch.Tensor):
        v0 = sources[0]
        dtype = _compute_dtype(v0)
        with torch.autocast(v0.device.type, enabled=False):
            w = norm_weight.to(dtype) * proj_weight.to(dtype).reshape(-1)  # [D]
            rstd, scores = [], []
            for v in sources:
                vf = v.to(dtype)
                r = torch.rsqrt(vf.pow(2).mean(-1) + eps)  # [...]
                rstd.append(r)
                scores.append((vf @ w) * r)
            scores_t = torch.stack(scores)  # [n, ...]
            alpha = scores_t.softmax(0)
            out = torch.zeros(v0.shape, dtype=dtype, device=v0.device)
            for a, v in zip(alpha, sources):
                out.addcmul_(a.unsqueeze(-1), v.to(dtype))
        ctx.save_for_backward(norm_weight, proj_weight, alpha, torch.stack(rstd), scores_t, *sources)
        return out.to(v0.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        norm_weight, proj_weight, alpha, rstd, scores, *sources = ctx.saved_tensors
        dtype = alpha.dtype
        D = grad_out.shape[-1]
        g = grad_out.to(dtype)
        w = norm_weight.to(dtype) * proj_weight.to(dtype).reshape(-1)
        # d out / d alpha_i = v_i; softmax backward: ds_i = alpha_i (dalpha_i - sum_j alpha_j dalpha_j)
        dalpha = torch.stack([torch.linalg.vecdot(g, v.to(dtype)) for v in sources])  # [n, ...]
        ds = alpha * (dalpha - (alpha * dalpha).sum(0, keepdim=True))
        # s_i = r_i (v_i . w), r_i = (mean(v_i^2) + eps)^-1/2: d s_i / d v_i = r_i w - s_i r_i^2 v_i / D
        dw = torch.zeros_like(w)
        grads = []
        for i, v in enumerate(sources):
            vf = v.to(dtype)
            c = ds[i] * rstd[i]  # [...]
            dv = alpha[i].unsqueeze(-1) * g + c.unsqueeze(-1) * w - (c * scores[i] * rstd[i] / D).unsqueeze(-1) * vf
            grads.append(dv.to(v.dtype))
            dw += torch.einsum("...,...d->d", c, vf)
        d_norm = (dw * proj_weight.to(dtype).reshape(-1)).to(norm_weight.dtype)
        d_proj = (dw * norm_weight.to(dtype)).reshape(proj_weight.shape).to(proj_weight.dtype)
        return d_norm, d_proj, None, *grads


def attn_res(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
             eps: float) -> torch.Tensor:
    """Depth attention over `sources` (n x [..., D], one shape and dtype, n >= 1) -> [..., D]; see the module
    docstring. Equals attn_res_reference; with one source it returns that source exactly (weight 1)."""
    assert sources, "attention residuals need at least one source"
    return _AttnRes.apply(norm_weight, proj_weight, float(eps), *sources)


class AttnRes(nn.Module):
    """One aggregation point: the learned pseudo-query w = norm_weight * proj_weight (stored as the checkpoint
    stores it, RMSNorm weight [D] and Linear(D, 1) weight [1, D]) and the norm eps."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.proj_weight = nn.Parameter(torch.zeros(1, dim))

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        return attn_res(sources, self.norm_weight, self.proj_weight, self.eps)

    def init_weights(self) -> None:
        # zero pseudo-query: every source weighs the same at the start (the paper's initialisation)
        self.norm_weight.data.fill_(1.0)
        self.proj_weight.data.zero_()
