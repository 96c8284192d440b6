"""The whole hybrid model: gradients against fp64 finite differences, meta builds, profile agreement."""

from __future__ import annotations

import pytest
import torch

from moestack.config import ModelSpec, load_model_spec
from moestack.model.transformer import Transformer, build_model
from moestack.planner.profile import profile_model

MICRO = {
    "name": "micro", "vocab_size": 32, "hidden_size": 16, "num_layers": 3, "max_seq_len": 64,
    "full_attention_layers": [2], "dense_layers": [1],
    "kda": {"num_heads": 2, "head_dim": 8, "gate_rank": 4, "chunk_size": 4},
    "mla": {"num_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
            "v_head_dim": 4, "indexer": {"num_heads": 2, "head_dim": 4, "top_k": 4}},
    "moe": {"num_experts": 4, "top_k": 2, "expert_intermediate_size": 8, "latent_size": 8,
            "num_shared_experts": 1, "shared_intermediate_size": 8,
            "router": {"seq_aux_loss_coef": 0.0, "bias_update_rate": 0.0}},
    "dense_mlp": {"intermediate_size": 24},
}


def test_whole_model_gradients_match_finite_differences():
    """Directional derivatives of the LM loss (fp64) through embedding, KDA, sparse Gated MLA with top-k
    selection, LatentMoE routing and the chunked CE head agree with central differences."""
    torch.manual_seed(0)
    spec = ModelSpec.model_validate(MICRO)
    model = build_model(spec, "cpu", seed=0).double()
    for layer in model.dsa_layers().values():
        layer.sparse, layer.indexer_loss_coef = True, 0.0  # T=12 > top_k=4: selection is active
    tokens = torch.randint(0, 32, (2, 12))
    targets = torch.randint(0, 32, (2, 12))
    params = [p for p in model.parameters()]
    loss = model(tokens, targets)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    eps = 1e-6
    for trial in range(3):
        direction = [torch.randn_like(p) for p in params]
        analytic = sum((g * d).sum() for g, d in zip(grads, direction)).item()
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.add_(eps * d)
            plus = model(tokens, targets).item()
            for p, d in zip(params, direction):
                p.sub_(2 * eps * d)
            minus = model(tokens, targets).item()
            for p, d in zip(params, direction):
                p.add_(eps * d)
        numeric = (plus - minus) / (2 * eps)
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (trial, numeric, analytic)
    # every parameter on the LM path receives a gradient (the indexer learns only from its KL loss, off here)
    named = dict(zip([n for n, _ in model.named_parameters()], grads))
    silent = [n for n, g in named.items() if g.abs().sum() == 0 and ".indexer." not in n]
    assert not silent, silent


@pytest.mark.parametrize("preset", ["tiny", "proxy", "kimi-k3", "kimi-k3.1-pro"])
def test_meta_build_matches_profile(preset):
    spec = load_model_spec(preset)
    model = build_model(spec, "meta")
    assert all(p.is_meta for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == profile_model(spec, 4096).total_params
    if preset == "kimi-k3":
        assert abs(n_params / 2779.48e9 - 1) < 5e-4  # MODEL.md: 2,779.48B counted from the released config


def test_logits_and_loss_agree_and_chunking_is_invisible():
    torch.manual_seed(1)
    spec = ModelSpec.model_validate(MICRO)
    model = build_model(spec, "cpu", seed=1)
    tokens, targets = torch.randint(0, 32, (2, 12)), torch.randint(0, 32, (2, 12))
    targets[0, :3] = -100  # ignored positions
    logits = model(tokens)
    keep = targets != -100
    expected = torch.nn.functional.cross_entropy(logits[keep].float(), targets[keep])
    torch.testing.assert_close(model(tokens, targets), expected, rtol=1e-6, atol=1e-6)
    from moestack.model import loss as loss_mod

    h = model.hidden_states(tokens)
    small = loss_mod.chunked_cross_entropy(h, model.lm_head.weight, targets, chunk_tokens=5)
    big = loss_mod.chunked_cross_entropy(h, model.lm_head.weight, targets, chunk_tokens=4096)
    torch.testing.assert_close(small[0], big[0], rtol=1e-6, atol=1e-6)
    assert small[1] == big[1] == keep.sum()


def test_unsupported_features_fail_by_name():
    from moestack.config import ConfigError

    spec = ModelSpec.model_validate({**MICRO, "moe": {**MICRO["moe"], "shared_expert_gate": True}})
    with pytest.raises(ConfigError, match="not supported: moe.shared_expert_gate"):
        Transformer(spec)
