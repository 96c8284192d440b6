"""Tensor parallelism (moestack.parallel.tensor): TP2 on gloo matches the single-process run (fp32, CPU).

Each rank builds the same seeded model twice: the reference stays single-device, the copy gets `apply_tp`. Both
take the same batches and AdamW steps; the test compares the loss of every step and every gradient after the
first backward (DTensor gradients gathered with full_tensor()).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _dist import run_ranks  # noqa: E402

from moestack.config.model_spec import ModelSpec, load_model_spec  # noqa: E402

B, T, STEPS = 2, 32, 3


def tiny_spec(**overrides) -> ModelSpec:
    """The tiny preset (KDA x3 + Gated DSA with indexer top-16, dense layer 1, LatentMoE with shared experts)."""
    data = load_model_spec("tiny").model_dump()
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return ModelSpec.model_validate(data)


def variant_spec(**overrides) -> ModelSpec:
    """Other module variants: GQA (qk-norm, qkv bias, output gate, partial rope), Gated-DeltaNet-style KDA (more
    value heads, per-head decay, direct decay input, low-rank output gate, kimi_linear gate), tied embeddings."""
    return tiny_spec(
        attention="gqa",
        mla=None,
        gqa={"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "qk_norm": True, "qkv_bias": True,
             "output_gate": True, "rope_fraction": 0.5},
        kda={"num_heads": 2, "num_v_heads": 4, "decay": "head", "gate": "kimi_linear", "gate_rank": None,
             "output_gate_rank": 16, "output_gate_act": "silu"},
        tie_word_embeddings=True,
        **overrides,
    )


def make_batch(spec: ModelSpec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    targets[0, 3:9] = -100  # ignored positions, unevenly spread over the sequence shards
    return tokens, targets


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _tp_worker(rank: int, world_size: int, spec: ModelSpec, sp: bool, dense_dsa: bool = False) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from moestack.model.transformer import build_model
    from moestack.parallel.tensor import apply_tp

    torch.manual_seed(0)
    ref = build_model(spec, "cpu", seed=0)
    for layer in ref.dsa_layers().values():
        layer.sparse = not dense_dsa
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world_size,))
    apply_tp(model, mesh, sequence_parallel=sp)

    models = (model, ref) if rank == 0 else (model,)  # the single-process reference runs on rank 0 only
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1) for m in models]
    tokens, _ = make_batch(spec, 0)
    out = {"loss": [], "ref_loss": [], "logits": model(tokens).detach(), "ref_logits": ref(tokens).detach()}
    for step in range(STEPS):
        tokens, targets = make_batch(spec, step)
        for m, key in zip(models, ("loss", "ref_loss")):
            loss = m(tokens, targets)
            loss.backward()
            out[key].append(loss.item())
        if step == 0:
            out["grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
            out["ref_grads"] = {n: p.grad.clone() for n, p in ref.named_parameters()} if rank == 0 else None
            # a replicated parameter's gradient is identical on every TP rank after the step's reductions
            out["norm_grad_local"] = model.layers["0"].attn_norm.weight.grad.to_local().clone()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        # the MoE is token-sharded under TP: the load counts of one optimizer step add up over the TP group
        for moe in model.moe_layers().values():
            counts = moe.router.tokens_per_expert.clone()
            dist.all_reduce(counts)
            moe.router.update_selection_bias(counts)
        for moe in ref.moe_layers().values():
            moe.router.update_selection_bias()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _check(results: list[dict], loss_rtol: float = 1e-5, grad_rtol: float = 2e-5) -> None:
    r0 = results[0]
    torch.testing.assert_close(torch.tensor(r0["loss"]), torch.tensor(r0["ref_loss"]), rtol=loss_rtol, atol=0)
    assert r0["grads"].keys() == r0["ref_grads"].keys()
    bad = {n: _rel(g, r0["ref_grads"][n]) for n, g in r0["grads"].items() if _rel(g, r0["ref_grads"][n]) > grad_rtol}
    assert not bad, f"gradients differ from the single-process run: {bad}"
    nonzero = [n for n, g in r0["ref_grads"].items() if g.abs().sum() > 0]
    assert len(nonzero) == len(r0["ref_grads"]), "every parameter must get a gradient for the check to mean much"
    torch.testing.assert_close(r0["logits"], r0["ref_logits"], rtol=1e-4, atol=1e-5)
    for other in results[1:]:  # replicated results agree across ranks
        assert other["loss"] == r0["loss"]
        torch.testing.assert_close(other["norm_grad_local"], r0["norm_grad_local"], rtol=0, atol=0)


@pytest.mark.slow
def test_tp2_sequence_parallel_matches_single_process():
    spec = tiny_spec(moe={"router": {**load_model_spec("tiny").moe.router.model_dump(), "seq_aux_loss_coef": 0.0}})
    _check(run_ranks(__file__, "_tp_worker", world_size=2, spec=spec, sp=True))


@pytest.mark.slow
def test_tp2_without_sp_dense_dsa_matches_single_process():
    spec = tiny_spec(moe={"router": {**load_model_spec("tiny").moe.router.model_dump(), "seq_aux_loss_coef": 0.0}})
    _check(run_ranks(__file__, "_tp_worker", world_size=2, spec=spec, sp=False, dense_dsa=True))


@pytest.mark.slow
def test_tp2_gqa_gated_deltanet_tied_matches_single_process():
    spec = variant_spec(moe={"router": {**load_model_spec("tiny").moe.router.model_dump(), "seq_aux_loss_coef": 0.0}})
    _check(run_ranks(__file__, "_tp_worker", world_size=2, spec=spec, sp=True))
