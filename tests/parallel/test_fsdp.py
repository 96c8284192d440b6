"""FSDP2 / ZeRO layouts (and EP folded onto them) on 4 gloo ranks vs the single-process run of the same global
batch: the loss of 3 optimizer steps, every gradient after step 1, the clipped global grad norm, router load
counts and selection biases (identical on every rank), fp32 on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _dist import run_ranks, small_model_spec  # noqa: E402

B_LOCAL, T, STEPS, CLIP = 1, 16, 3, 0.05

LAYOUTS = {
    "dp4": dict(dp_replicate=4, zero_stage=0),
    "zero3": dict(dp_shard=4, zero_stage=3),
    "zero2": dict(dp_shard=4, zero_stage=2),
    "hsdp2x2": dict(dp_replicate=2, dp_shard=2, zero_stage=3),
    "ep2_zero3": dict(dp_shard=4, zero_stage=3, ep=2),
    "ep4_dp": dict(dp_replicate=4, zero_stage=0, ep=4),
    "hier_ep2x2_zero2": dict(dp_shard=4, zero_stage=2, ep=4, dispatcher="hierarchical"),
}


def _batches(world: int, vocab: int):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (world * B_LOCAL, T + 1), generator=g) for _ in range(STEPS)]


def _train(model, batches, rows, clip_fn, reduce_counts, loss_mean) -> dict:
    from moestack.config.train_spec import OptimizerSpec
    from moestack.train.optim import build_optimizer

    opt = build_optimizer(model, OptimizerSpec(lr=1e-2, weight_decay=0.1))
    out = {"loss": [], "norm": [], "bias": [], "counts": []}
    moes = [b.ffn for b in model.layers.values() if b.kind.ffn == "moe"]
    for step, tokens in enumerate(batches):
        tokens = tokens[rows]
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        if step == 0:
            out["grads"] = {n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
        out["norm"].append(float(clip_fn([p for p in model.parameters()], CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        counts = [m.router.tokens_per_expert.clone() for m in moes]
        reduce_counts(counts)
        for m, c in zip(moes, counts):
            m.router.update_selection_bias(c)
        out["counts"].append(torch.stack(counts))
        out["bias"].append(torch.stack([m.router.selection_bias.clone() for m in moes]))
        out["loss"].append(loss_mean(float(loss)))
    out["params"] = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    return out


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _fsdp_worker(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor

    from moestack.config.plan import make_plan
    from moestack.model.transformer import build_model
    from moestack.parallel import all_reduce_mean, all_reduce_sum_, build_meshes, clip_grad_norm_, parallelize
    from moestack.train.optim import clip_grad_norm

    spec = small_model_spec()
    batches = _batches(world, spec.vocab_size)
    ref = _train(build_model(spec, "cpu", seed=0), batches, slice(None), clip_grad_norm, lambda c: None,
                 lambda x: x)
    results = {}
    for name, layout in LAYOUTS.items():
        plan = make_plan(model="tiny", cluster="cpu", devices=world, seq_len=T, global_batch_size=world * B_LOCAL,
                         micro_batch_size=B_LOCAL, **layout)
        meshes = build_meshes(plan, "cpu", ep_domain_size=2 if plan.dispatcher == "hierarchical" else None)
        model = parallelize(build_model(spec, "cpu", seed=0), plan, meshes)
        sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
        assert len(sharded) == len(list(model.parameters())), "every parameter is FSDP-managed"
        if plan.zero_stage > 0:  # ZeRO really shards: this rank holds a fraction of the embedding
            emb = model.embed.weight
            assert emb.to_local().numel() < emb.numel(), name
        dp_rank = meshes.dp_rank
        rows = slice(dp_rank * B_LOCAL, (dp_rank + 1) * B_LOCAL)
        got = _train(model, batches, rows, clip_grad_norm_, lambda c: all_reduce_sum_(c, meshes.dp_group),
                     lambda x: all_reduce_mean(x, meshes.dp_group))
        errs = {"loss": max(abs(a - b) / abs(b) for a, b in zip(got["loss"], ref["loss"])),
                "norm": max(abs(a - b) / abs(b) for a, b in zip(got["norm"], ref["norm"])),
                "counts": float(not all(torch.equal(a, b) for a, b in zip(got["counts"], ref["counts"]))),
                "bias": float(not all(torch.equal(a, b) for a, b in zip(got["bias"], ref["bias"])))}
        assert set(got["grads"]) == set(ref["grads"]), name
        errs["grad"] = max(_rel(got["grads"][n], ref["grads"][n]) for n in ref["grads"])
        errs["param"] = max(_rel(got["params"][n], ref["params"][n]) for n in ref["params"])
        errs["clipped"] = float(min(ref["norm"]) > CLIP)  # clipping was active in every step
        results[name] = (errs, got["bias"][-1])
    return results


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_fsdp_and_ep_layouts_match_single_process():
    results = run_ranks(__file__, "_fsdp_worker", world_size=4, timeout=240)
    for name in LAYOUTS:
        for rank, per_layout in enumerate(results):
            errs, bias = per_layout[name]
            where = f"{name} rank {rank}"
            assert errs["clipped"] == 1.0, f"{where}: clip threshold never reached; the test would not test clipping"
            assert errs["loss"] < 1e-5, f"{where}: loss rel err {errs['loss']:.2e}"
            assert errs["norm"] < 1e-5, f"{where}: grad-norm rel err {errs['norm']:.2e}"
            assert errs["grad"] < 1e-5, f"{where}: grad rel err {errs['grad']:.2e}"
            assert errs["param"] < 1e-5, f"{where}: param rel err after {STEPS} steps {errs['param']:.2e}"
            assert errs["counts"] == 0.0, f"{where}: all-reduced router counts differ from single-process"
            assert errs["bias"] == 0.0, f"{where}: router biases differ from single-process"
            assert torch.equal(bias, results[0][name][1]), f"{where}: router biases differ between ranks"
