"""The hybrid decoder: embedding -> blocks (KDA / Gated MLA-DSA / GQA mixers, dense or MoE FFNs) -> norm -> head.

Single-device math only; parallelism is applied from outside (moestack.parallel). Blocks live in a ModuleDict keyed
by layer number so pipeline stages can drop layers while keeping fully-qualified parameter names stable.

With Attention Residuals (spec.attn_res_block_size = S; moestack/model/attn_res.py) the blocks pass the completed block
representations b_0 = embedding, b_1, ... and the partial sum of the current block instead of one hidden state; before
layer l with l % S == 0 the partial sum becomes a completed block; the final norm reads `out_res` over all of them. A
pipeline stage other than the last returns (and a stage other than the first takes) that state stacked as one tensor
[n + 1, B, T, D]: the n completed blocks, then the partial sum (n = spec.attn_res_blocks_before(first layer)).
"""

from __future__ import annotations

import torch
from torch import nn

from moestack.config.model_spec import ModelSpec
from moestack.model.attn_res import AttnRes
from moestack.model.block import Block
from moestack.model.init import init_model
from moestack.model.loss import chunked_cross_entropy
from moestack.model.norm import RMSNorm
from moestack.model.weights import compute_weight


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        spec.check_buildable()  # features the profiler counts but the builder cannot build fail here, by name
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(spec, kind, i) for i, kind in enumerate(spec.layer_kinds())})
        # Attention Residuals: the output aggregation over all blocks, before the final norm
        self.out_res = AttnRes(spec.hidden_size, spec.norm_eps) if spec.attn_res_block_size is not None else None
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self, std: float | None = None) -> None:
        std = self.spec.init_std if std is None else std
        if self.embed is not None:
            nn.init.normal_(self.embed.weight, std=std)
        for block in self.layers.values():
            block.init_weights(std)
        if self.norm is not None:
            self.norm.weight.fill_(1.0)
        if getattr(self, "out_res", None) is not None:
            self.out_res.init_weights()
        if self.lm_head is not None and not self.spec.tie_word_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)

    def hidden_states(self, tokens_or_h: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] (or incoming hidden [B, T, D] on a later pipeline stage) -> hidden [B, T, D].
        With Attention Residuals a stage other than the first takes, and one other than the last returns, the
        stacked state [n + 1, B, T, D] (module docstring)."""
        if self.spec.attn_res_block_size is not None:
            return self._hidden_states_attn_res(tokens_or_h, cu_seqlens)
        h = self.embed(tokens_or_h) if self.embed is not None else tokens_or_h
        for block in self.layers.values():
            h = block(h, cu_seqlens)
        return self.norm(h) if self.norm is not None else h

    def _hidden_states_attn_res(self, tokens_or_state: torch.Tensor, cu_seqlens: torch.Tensor | None
                                ) -> torch.Tensor:
        S = self.spec.attn_res_block_size
        if self.embed is not None:
            blocks, partial = [], self.embed(tokens_or_state)  # the embedding: the first block, completed at layer 0
        else:
            assert tokens_or_state.dim() == 4, "attention residuals: a later stage takes the state [n + 1, B, T, D]"
            *blocks, partial = tokens_or_state.unbind(0)
        for block in self.layers.values():
            if block.layer_id % S == 0:  # the current block is complete
                blocks, partial = [*blocks, partial], None
            partial = block(partial, cu_seqlens, blocks=blocks)
        if self.norm is None:  # a pipeline stage before the last
            return torch.stack([*blocks, partial])
        return self.norm(self.out_res([*blocks, partial]))

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Without targets: logits [B, T, V] (or hidden states on a stage without a head).
        With targets [B, T]: the mean token cross-entropy (chunked; logits never fully materialised)."""
        h = self.hidden_states(tokens, cu_seqlens)
        if self.lm_head is None:
            return h
        if targets is None:
            return self.lm_head(h)
        loss_sum, count = chunked_cross_entropy(h, compute_weight(self.lm_head), targets)
        return loss_sum / count.clamp(min=1)

    def moe_layers(self) -> dict[str, nn.Module]:
        return {name: b.ffn for name, b in self.layers.items() if b.kind.ffn == "moe"}

    def dsa_layers(self) -> dict[str, nn.Module]:
        return {
            name: b.attn
            for name, b in self.layers.items()
            if b.kind.mixer == "mla" and getattr(b.attn, "indexer", None) is not None
        }


def build_model(spec: ModelSpec, device: torch.device | str = "cpu", seed: int | None = None) -> Transformer:
    """Build and initialise on `device`. On "meta" nothing is allocated (inspect sizes of a 2.8T model; shard it,
    then `moestack.parallel.init.materialize` gives each rank exactly its slice of this build's values).

    Values: `moestack.model.init.init_model` (init_weights' distributions, drawn per tensor name and row block from
    `seed`; seed None draws one from torch's global generator)."""
    device = torch.device(device)
    with torch.device(device):
        model = Transformer(spec)
    if device.type != "meta":
        init_model(model, seed, device)
    return model
