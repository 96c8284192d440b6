"""One pre-norm residual block: x + mixer(norm(x)), then + ffn(norm(x)).

With Attention Residuals (spec.attn_res_block_size; the math and sources: moestack/model/attn_res.py) the block
reads the completed block representations `blocks` and the running partial sum x of its own block instead of one
residual stream:

    h = AttnRes_attn(blocks + [x])      (blocks alone when x is None: this layer starts a new block)
    x = x + mixer(attn_norm(h))         (x = mixer(...) when x was None)
    h = AttnRes_ffn(blocks + [x])
    x = x + ffn(ffn_norm(h))            -> returned: the partial sum after this layer

The caller (Transformer.hidden_states) closes a block, appending the partial sum to `blocks`, before every layer
whose index is a multiple of the block size.
"""

from __future__ import annotations

import torch
from torch import nn

from moestack.config.model_spec import LayerKind, ModelSpec
from moestack.model.attn_res import AttnRes
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
        self.attn_res = self.ffn_res = None
        if spec.attn_res_block_size is not None:
            self.attn_res = AttnRes(spec.hidden_size, spec.norm_eps)  # before the mixer
            self.ffn_res = AttnRes(spec.hidden_size, spec.norm_eps)  # before the ffn

    def forward(self, x_BTD: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
                blocks: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x_BTD [B, T, D]: the residual stream; with Attention Residuals the partial sum of the current block
        (None at a block's first layer) and blocks the completed block representations (module docstring)."""
        if self.attn_res is not None:
            return self._forward_attn_res(x_BTD, cu_seqlens, blocks)
        if cu_seqlens is None:
            x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD))
        else:
            x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cu_seqlens=cu_seqlens)
        return x_BTD + self.ffn(self.ffn_norm(x_BTD))

    def _forward_attn_res(self, x_BTD: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                          blocks: list[torch.Tensor] | None) -> torch.Tensor:
        assert blocks, "attention residuals: a block needs the completed blocks (at least the embedding)"
        h = self.attn_res(blocks if x_BTD is None else [*blocks, x_BTD])
        h = self.attn_norm(h)
        a = self.attn(h) if cu_seqlens is None else self.attn(h, cu_seqlens=cu_seqlens)
        x_BTD = a if x_BTD is None else x_BTD + a
        h = self.ffn_res([*blocks, x_BTD])
        return x_BTD + self.ffn(self.ffn_norm(h))

    def init_weights(self, std: float) -> None:
        self.attn_norm.weight.data.fill_(1.0)
        self.ffn_norm.weight.data.fill_(1.0)
        if self.attn_res is not None:
            self.attn_res.init_weights()
            self.ffn_res.init_weights()
        self.attn.init_weights(std)
        self.ffn.init_weights(std)
