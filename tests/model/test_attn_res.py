"""Block Attention Residuals (moestack/model/attn_res.py): the op against its reference and fp64 finite
differences, the model's wiring against a loop-clear transcription of K3's layer (prefix sum / block residual),
recompute, pipeline stages, and that attn_res_block_size None leaves the plain model unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

from moestack.config import ModelSpec, load_model_spec
from moestack.config.plan import RecomputePolicy
from moestack.memory.recompute import apply_recompute
from moestack.model.attn_res import attn_res, attn_res_reference
from moestack.model.aux_loss import set_aux_loss_scale
from moestack.model.transformer import build_model
from moestack.parallel.pipeline import build_stage_modules

MICRO = {  # test_transformer.py's micro model: KDA + dense, sparse Gated DSA + LatentMoE, KDA + LatentMoE
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


def _sources(n: int, shape: tuple[int, ...], dtype=torch.float64, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # different scales per source: the RMS normalisation of the keys matters
    return [(torch.randn(shape, generator=g, dtype=torch.float64) * (0.5 + i)).to(dtype).requires_grad_()
            for i in range(n)]


def _weights(D: int, dtype=torch.float64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    norm = (1 + 0.3 * torch.randn(D, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    proj = torch.randn(1, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return norm, proj


@pytest.mark.parametrize("n, shape", [(1, (3, 7)), (2, (2, 3, 8)), (4, (1, 3, 5)), (9, (2, 4))])
def test_op_gradients_match_finite_differences(n, shape):
    sources = _sources(n, shape)
    norm, proj = _weights(shape[-1])
    fn = lambda nw, pw, *v: attn_res(list(v), nw, pw, 1e-5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (norm, proj, *sources), eps=1e-6, atol=1e-8, rtol=1e-6)
    ref = lambda nw, pw, *v: attn_res_reference(list(v), nw, pw, 1e-5)  # noqa: E731
    assert torch.autograd.gradcheck(ref, (norm, proj, *sources), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_op_matches_reference(dtype, tol):
    """Forward and every gradient (sources, both weight factors) against the stacked reference, fresh inputs."""
    for n, shape in ((3, (2, 11, 40)), (7, (5, 33))):
        sources = _sources(n, shape, dtype, seed=n)
        norm, proj = _weights(shape[-1], dtype, seed=n + 1)
        g = torch.randn(shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(dtype)
        out = attn_res(sources, norm, proj, 1e-5)
        grads = torch.autograd.grad(out, [norm, proj, *sources], g)
        ref = attn_res_reference(sources, norm, proj, 1e-5)
        ref_grads = torch.autograd.grad(ref, [norm, proj, *sources], g)
        assert out.dtype == dtype and torch.isfinite(out).all()
        scale = ref.double().abs().max()
        assert (out.double() - ref.double()).abs().max() <= tol * scale
        for a, b in zip(grads, ref_grads, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert (a.double() - b.double()).abs().max() <= tol * b.double().abs().max().clamp(min=1e-30)


def test_one_source_is_that_source_and_weights_get_zero_gradient():
    """K3's layer 0 mixes nothing (the HF code skips it): one source comes back exactly, its gradient passes
    unchanged, and the unused pseudo-query gets an exact zero gradient (every parameter still has a .grad)."""
    (v,) = _sources(1, (3, 16), torch.float32)
    norm, proj = _weights(16, torch.float32)
    out = attn_res([v], norm, proj, 1e-5)
    assert torch.equal(out, v)
    g = torch.randn(3, 16)
    dn, dp, dv = torch.autograd.grad(out, [norm, proj, v], g)
    assert torch.equal(dv, g) and not dn.any() and not dp.any()


def test_softmax_weights_follow_the_pseudo_query():
    """With w pointing along source 1's direction, source 1 dominates; RMS normalisation makes the weights
    independent of each source's scale; zero pseudo-query = the plain mean."""
    D = 8
    e = torch.eye(D, dtype=torch.float64)
    sources = [e[0].expand(2, D) * 100.0, e[1].expand(2, D) * 0.01, e[2].expand(2, D)]
    norm = torch.ones(D, dtype=torch.float64)
    proj = (20.0 * e[1]).reshape(1, D)
    out = attn_res(sources, norm, proj, 0.0)
    alpha1 = out[0, 1] / 0.01
    assert alpha1 > 0.999  # score 20 * sqrt(D) against 0: its scale (0.01) does not matter
    mean = attn_res(sources, norm, torch.zeros(1, D, dtype=torch.float64), 1e-5)
    torch.testing.assert_close(mean, sum(sources) / 3, rtol=1e-15, atol=1e-15)


# ---------------------------------------------------------------------------------------------------------------
# the model

def _spec(block_size: int | None, base: dict | None = None, **upd) -> ModelSpec:
    data = copy.deepcopy(base if base is not None else load_model_spec("tiny").model_dump())
    data["attn_res_block_size"] = block_size
    data.update(upd)
    return ModelSpec.model_validate(data)


def _randomise_attn_res(model) -> None:
    """Non-trivial pseudo-queries (the zero init would make every mix a plain mean)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res." in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.3 if "proj" in name else 0.1) +
                        (1.0 if "norm_weight" in name else 0.0))


def _k3_layer_reference(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits by a loop-clear transcription of K3's decoder (the published modeling code's structure, with the
    stacked reference op): a running prefix sum and a growing list of block residuals; layer l mixes the stack and
    the prefix before its mixer (skipped while the stack is empty), pushes the prefix every S layers, mixes again
    before its FFN; the output mixes everything before the final norm."""
    S = model.spec.attn_res_block_size
    mix = lambda srcs, m: attn_res_reference(srcs, m.norm_weight, m.proj_weight, m.eps)  # noqa: E731
    prefix = model.embed(tokens)
    block_residual: list[torch.Tensor] = []
    for l, blk in enumerate(model.layers.values()):
        h = mix([*block_residual, prefix], blk.attn_res) if block_residual else prefix
        if l % S == 0:
            block_residual.append(prefix)
            prefix = None
        a = blk.attn(blk.attn_norm(h))
        prefix = a if prefix is None else prefix + a
        h = mix([*block_residual, prefix], blk.ffn_res)
        prefix = prefix + blk.ffn(blk.ffn_norm(h))
    h = mix([*block_residual, prefix], model.out_res)
    return model.lm_head(model.norm(h))


@pytest.mark.parametrize("block_size", [1, 2, 3, 5])
def test_model_matches_the_k3_transcription(block_size):
    """fp64 logits and every gradient equal the loop-clear transcription (4 layers: blocks of 1, 2, 3 layers and
    one block of all four plus the embedding)."""
    spec = _spec(block_size, MICRO, num_layers=4)
    model = build_model(spec, "cpu", seed=0).double()
    _randomise_attn_res(model)
    tokens = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    g = torch.randn(2, 24, spec.vocab_size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    params = list(model.parameters())
    set_aux_loss_scale(0.0)  # the aux losses ride on activations; compare the LM path alone
    try:
        out = model(tokens)
        grads = torch.autograd.grad(out, params, g, allow_unused=True)
        ref = _k3_layer_reference(model, tokens)
        ref_grads = torch.autograd.grad(ref, params, g, allow_unused=True)
    finally:
        set_aux_loss_scale(1.0)
    assert (out - ref).abs().max() <= 1e-12 * ref.abs().max()
    names = [n for n, _ in model.named_parameters()]
    for name, a, b in zip(names, grads, ref_grads, strict=True):
        if b is None:  # the transcription skips layer 0's pre-mixer mix (one source): exactly zero here
            assert name.startswith("layers.0.attn_res.") and a is not None and not a.any(), name
            continue
        assert (a - b).abs().max() <= 1e-11 * b.abs().max().clamp(min=1e-30), name
    n_blocks = -(-spec.num_layers // block_size)  # completed blocks the output reads: embedding + closed ones
    assert spec.attn_res_blocks_before(spec.num_layers) == n_blocks


def test_whole_model_gradients_match_finite_differences():
    """Directional derivatives of the fp64 LM loss with attention residuals (3 layers, blocks of 2: the output
    reads the embedding, block 1 and a partial block) agree with central differences; every parameter on the LM
    path but layer 0's pre-mixer mix (one source: exact zero, as in K3) gets a gradient."""
    torch.manual_seed(0)
    spec = _spec(2, MICRO)
    model = build_model(spec, "cpu", seed=0).double()
    _randomise_attn_res(model)
    for layer in model.dsa_layers().values():
        layer.sparse, layer.indexer_loss_coef = True, 0.0
    tokens = torch.randint(0, 32, (2, 12))
    targets = torch.randint(0, 32, (2, 12))
    params = list(model.parameters())
    grads = torch.autograd.grad(model(tokens, targets), params, allow_unused=True)
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
    named = dict(zip([n for n, _ in model.named_parameters()], grads))
    silent = sorted(n for n, g in named.items() if g.abs().sum() == 0 and ".indexer." not in n)
    assert silent == ["layers.0.attn_res.norm_weight", "layers.0.attn_res.proj_weight"], silent


def test_none_is_the_plain_model_bit_for_bit():
    """attn_res_block_size None: no new parameters, and the forward is exactly x + mixer(norm(x)), + ffn(norm(x))."""
    spec = load_model_spec("tiny")
    assert spec.attn_res_block_size is None
    model = build_model(spec, "cpu", seed=0)
    assert not any("_res." in n for n, _ in model.named_parameters()) and model.out_res is None
    torch.manual_seed(0)
    assert torch.equal(model.embed.weight, build_model(spec, "cpu", seed=0).embed.weight)
    tokens = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = model.embed(tokens)
        for blk in model.layers.values():
            h = h + blk.attn(blk.attn_norm(h))
            h = h + blk.ffn(blk.ffn_norm(h))
        want = model.lm_head(model.norm(h))
        assert torch.equal(model(tokens), want)
    # the same seed builds the same plain weights with or without the feature's code path in the tree
    with_res = build_model(_spec(2), "cpu", seed=0)
    plain = dict(model.named_parameters())
    for name, p in with_res.named_parameters():
        if "_res." not in name:
            assert torch.equal(p, plain[name]), name


def test_init_is_uniform_mixing():
    model = build_model(_spec(2), "cpu", seed=0)
    res = {n: p for n, p in model.named_parameters() if "_res." in n}
    assert len(res) == 2 * 2 * 4 + 2  # two mixes per layer, the output mix; two factors each
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in res.items() if "norm_weight" in n)
    assert all(not p.any() for n, p in res.items() if "proj_weight" in n)


POLICIES = [RecomputePolicy.uniform("full"), RecomputePolicy.uniform("selective"),
            RecomputePolicy(kda="full", attention="none", moe="selective", mlp="full")]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.short())
def test_recompute_is_exact(policy):
    """Loss and gradients bitwise equal with and without recompute (the block's mixes inside a wrapped block
    and outside wrapped parts)."""
    spec = _spec(2, MICRO, num_layers=4)
    model = build_model(spec, "cpu", seed=0)
    _randomise_attn_res(model)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.vocab_size, (1, 32), generator=g)
    targets = torch.randint(0, spec.vocab_size, (1, 32), generator=g)

    def step(m):
        loss = m(tokens, targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    loss0, grads0 = step(copy.deepcopy(model))
    wrapped = copy.deepcopy(model)
    assert apply_recompute(wrapped, policy)
    loss1, grads1 = step(wrapped)
    assert torch.equal(loss0, loss1)
    for name, g0 in grads0.items():
        assert torch.equal(grads1[name], g0), name


@pytest.mark.parametrize("cuts", [[1], [2], [1, 3], [2, 3]])
def test_pipeline_stages_carry_the_block_state(cuts):
    """Stages cut anywhere (before, at and after a block boundary; blocks of 2) pass [n + 1, B, T, D] and chain to
    the whole model's logits exactly."""
    spec = _spec(2)
    model = build_model(spec, "cpu", seed=0)
    _randomise_attn_res(model)
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    bounds = [0, *cuts, spec.num_layers]
    stages = [build_stage_modules(model, list(range(bounds[s], bounds[s + 1])), s == 0, s == len(cuts))
              for s in range(len(cuts) + 1)]
    assert stages[-1].out_res is model.out_res and stages[0].out_res is None
    with torch.no_grad():
        x = tokens
        for s, stage in enumerate(stages):
            x = stage(x)
            if s < len(cuts):
                assert x.shape == (spec.attn_res_blocks_before(bounds[s + 1]) + 1, 2, 16, spec.hidden_size)
        torch.testing.assert_close(x, model(tokens), rtol=0, atol=0)
