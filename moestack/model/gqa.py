"""Softmax grouped-query attention (Llama / Mixtral / Qwen3 / Qwen3-Next full-attention layers).

q, k, v projections (bias if qkv_bias), optional per-head RMSNorm on q and k before RoPE (Qwen3 qk_norm), RoPE in
the "half" pair layout of the HF checkpoints on the first rope_fraction of each head (partial rotary, Qwen3-Next),
causal SDPA with H / H_kv query heads per key/value head, optional
sigmoid output gate (Qwen3-Next: attn_out * sigmoid(g_proj x) before o_proj), o_proj.

Legend: B batch, T tokens, D hidden, H query heads, G key/value heads, E head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moestack.config.model_spec import GQASpec
from moestack.model.norm import RMSNorm
from moestack.model.rope import apply_rope, rope_cos_sin, rope_positions
from moestack.ops.dsa.reference import causal_mask


class GQAAttention(nn.Module):
    """Causal GQA token mixer: x [B,T,D] -> y [B,T,D]; optional cu_seqlens [N+1] (B == 1 packed documents)."""

    def __init__(self, hidden_size: int, spec: GQASpec, head_dim: int, norm_eps: float):
        super().__init__()
        self.spec = spec
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, head_dim
        H, G, E = spec.num_heads, spec.num_kv_heads, head_dim
        if spec.use_rope and spec.rope_scaling is not None:
            raise NotImplementedError(f"GQAAttention: rope_scaling '{spec.rope_scaling.type}' is not implemented")
        self.rope_dim = int(E * spec.rope_fraction) if spec.use_rope else 0  # HF: int(head_dim * partial factor)
        assert self.rope_dim % 2 == 0, f"rotary dims must be even, got {self.rope_dim}"
        self.q_proj = nn.Linear(hidden_size, H * E, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(hidden_size, G * E, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(hidden_size, G * E, bias=spec.qkv_bias)
        self.q_norm = RMSNorm(E, norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(E, norm_eps) if spec.qk_norm else None
        self.g_proj = nn.Linear(hidden_size, H * E, bias=False) if spec.output_gate else None
        self.o_proj = nn.Linear(H * E, hidden_size, bias=False)

    def init_weights(self, std: float) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.o_proj):
            if lin is None:
                continue
            nn.init.normal_(lin.weight, mean=0.0, std=std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                nn.init.ones_(norm.weight)

    def forward(self, x_BTD: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x [B,T,D] -> y [B,T,D]; with cu_seqlens no token attends across a document boundary."""
        B, T, _ = x_BTD.shape
        assert cu_seqlens is None or B == 1, "cu_seqlens (packed documents) needs batch size 1"
        E = self.head_dim  # the head counts come from the projections' widths (a TP rank holds some of the heads)
        q_BTHE = self.q_proj(x_BTD).view(B, T, -1, E)
        k_BTGE = self.k_proj(x_BTD).view(B, T, -1, E)
        v_BTGE = self.v_proj(x_BTD).view(B, T, -1, E)
        H, G = q_BTHE.shape[2], k_BTGE.shape[2]
        if self.q_norm is not None:
            q_BTHE, k_BTGE = self.q_norm(q_BTHE), self.k_norm(k_BTGE)
        if self.rope_dim:
            dt = torch.float64 if x_BTD.dtype == torch.float64 else torch.float32
            rope = rope_cos_sin(rope_positions(T, x_BTD.device, cu_seqlens), self.rope_dim, self.spec.rope_theta, dt)
            q_BTHE, k_BTGE = self._rotate(q_BTHE, rope), self._rotate(k_BTGE, rope)
        mask = None if cu_seqlens is None else causal_mask(T, x_BTD.device, cu_seqlens)
        o_BHTE = F.scaled_dot_product_attention(
            q_BTHE.transpose(1, 2),
            k_BTGE.transpose(1, 2),
            v_BTGE.transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=G != H,
        )
        o_BTHE = o_BHTE.transpose(1, 2)
        if self.g_proj is not None:
            o_BTHE = o_BTHE * torch.sigmoid(self.g_proj(x_BTD)).view(B, T, H, E)
        return self.o_proj(o_BTHE.reshape(B, T, H * E))

    def _rotate(self, x_BTHE: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        r = self.rope_dim
        if r == x_BTHE.shape[-1]:
            return apply_rope(x_BTHE, *rope)
        return torch.cat((apply_rope(x_BTHE[..., :r], *rope), x_BTHE[..., r:]), dim=-1)
