"""One pre-norm residual block: x + mixer(norm(x)), then + ffn(norm(x))."""

from __future__ import annotations

import torch
from torch import nn

from moestack.config.model_spec import LayerKind, ModelSpec
from moestack.model.norm import RMSNorm


def build_mixer(spec: ModelSpec, mixer: str) -> nn.Module:
    if mixer == "kda":
        from moestack.model.kda import KDAAttention

        return KDAAttention(spec.hidden_size, spec.kda, spec.norm_eps)
    if mixer == "mla":
        from moestack.model.dsa import GatedMLA

        return GatedMLA(spec.hidden_size, spec.mla, spec.norm_eps)
    if mixer == "gqa":
        from moestack.model.gqa import GQAAttention

        return GQAAttention(spec.hidden_size, spec.gqa, spec.gqa_head_dim, spec.norm_eps)
    raise ValueError(f"unknown mixer kind '{mixer}'")


def build_ffn(spec: ModelSpec, ffn: str) -> nn.Module:
    if ffn == "dense":
        from moestack.model.mlp import GLUMLP

        return GLUMLP(
            spec.hidden_size, spec.dense_mlp.intermediate_size, spec.activation, spec.situ_beta, spec.situ_linear_beta
        )
    if ffn == "moe":
        from moestack.model.moe import MoE

        return MoE(spec.hidden_size, spec.moe, spec.activation, spec.situ_beta, spec.situ_linear_beta, spec.norm_eps)
    raise ValueError(f"unknown ffn kind '{ffn}'")


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, kind: LayerKind, layer_id: int):
        super().__init__()
        self.kind = kind
        self.layer_id = layer_id  # 0-based
        self.attn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.attn = build_mixer(spec, kind.mixer)
        self.ffn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.ffn = build_ffn(spec, kind.ffn)

    def forward(self, x_BTD: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        if cu_seqlens is None:
            x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD))
        else:
            x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cu_seqlens=cu_seqlens)
        return x_BTD + self.ffn(self.ffn_norm(x_BTD))

    def init_weights(self, std: float) -> None:
        self.attn_norm.weight.data.fill_(1.0)
        self.ffn_norm.weight.data.fill_(1.0)
        self.attn.init_weights(std)
        self.ffn.init_weights(std)
