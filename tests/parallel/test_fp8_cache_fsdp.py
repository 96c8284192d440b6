"""The FP8 weight cache (fp8_weight_cache.py) under FSDP2 ZeRO-3 on 2 gloo ranks: the same training run with the
cache on and off gives bitwise the same losses, gradients and parameters, with one quantisation per weight and
optimizer step; the same run without the cache's optimizer-step hook (the control) differs from the second step on.

FSDP2 gathers the unsharded expert weights into new storage for every forward and (ZeRO-3) backward, without moving
their version counter, and the fused optimizer update does not move it either: the cache keys on the unsharded
parameter object and is emptied at every optimizer step. Two MoE layers (their gathers may reuse each other's
storage), 2 optimizer steps of 2 micro-batches each (gradient accumulation). The experts run the "fp8" backend's v3
path (on CPU its Triton kernels in the interpreter; the backend is registered as available inside the ranks for
this job only). Before session 12 the key held the data pointer, which changes with every gather: 1-2 hits of 16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _dist import run_ranks, small_model_spec  # noqa: E402

STEPS, MICRO, ROWS, T = 2, 2, 2, 8  # ROWS sequences of T tokens per rank and micro-batch
LAYERS = 3  # a dense layer, then two KDA + MoE layers


def _worker(rank: int, world: int) -> dict:
    import os

    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from moestack.config.model_spec import ModelSpec
    from moestack.config.plan import make_plan
    from moestack.config.train_spec import OptimizerSpec
    from moestack.model.transformer import build_model
    from moestack.ops import moe as moe_ops
    from moestack.ops.moe import fp8_weight_cache as wc
    from moestack.parallel import build_meshes, parallelize
    from moestack.train.optim import build_optimizer

    spec = small_model_spec().model_dump()
    spec.update(num_layers=LAYERS, full_attention_layers=[], dense_layers=[1])
    spec = ModelSpec.model_validate(spec)
    g = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, spec.vocab_size, (world * MICRO * ROWS, T + 1), generator=g) for _ in range(STEPS)]
    fp8_entry = moe_ops._BACKENDS["fp8"]
    moe_ops.register_backend("fp8", fp8_entry[0], lambda: True)  # CPU: the interpreter runs its Triton path
    out = {}
    try:
        for cache in ("1", "0", "stale"):  # stale: the cache without its optimizer-step hook (the control)
            os.environ["MOESTACK_FP8_CACHE"] = "0" if cache == "0" else "1"
            if cache == "stale":
                wc._step_hook.remove()
            wc.clear()
            wc.stats.update(hits=0, misses=0)
            plan = make_plan(model="tiny", cluster="cpu", devices=world, seq_len=T, global_batch_size=world * ROWS,
                             micro_batch_size=ROWS, dp_shard=world, zero_stage=3)
            model = build_model(spec, "cpu", seed=0)
            moes = [b.ffn for b in model.layers.values() if b.kind.ffn == "moe"]
            assert len(moes) == LAYERS - 1
            for moe in moes:
                moe.experts.backend = "fp8"
            init = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n}
            model = parallelize(model, plan, build_meshes(plan, "cpu"))
            opt = build_optimizer(model, OptimizerSpec(lr=1e-2, weight_decay=0.1))
            losses, grads = [], None
            for step in range(STEPS):
                for mb in range(MICRO):
                    tokens = batches[step][(rank * MICRO + mb) * ROWS:(rank * MICRO + mb + 1) * ROWS]
                    loss = model(tokens[:, :-1], tokens[:, 1:]) / MICRO
                    loss.backward()
                    losses.append(float(loss))
                if step == 0:
                    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if "experts" in n}
                opt.step()
                opt.zero_grad(set_to_none=True)
            params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                      for n, p in model.named_parameters()}
            out[cache] = {"losses": losses, "grads": grads, "params": params, "stats": dict(wc.stats), "init": init}
    finally:
        if cache == "stale":
            wc._step_hook = register_optimizer_step_post_hook(wc._after_optimizer_step)
        moe_ops.register_backend("fp8", *fp8_entry)
        os.environ.pop("MOESTACK_FP8_CACHE", None)
        os.environ.pop("MOESTACK_FP8_V3", None)
        wc.clear()
    return out


def test_fp8_weight_cache_under_fsdp2(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU ranks with the fp8 kernels in the interpreter (a GPU session has no TRITON_INTERPRET)")
    monkeypatch.setenv("MOESTACK_FP8_V3", "1")
    results = run_ranks(__file__, "_worker", world_size=2, timeout=900)
    for rank, out in enumerate(results):
        on, off = out["1"], out["0"]
        assert off["stats"]["hits"] == off["stats"]["misses"] == 0  # MOESTACK_FP8_CACHE=0: never consulted
        # per step and weight one quantisation: the second micro-batch and every backward (ZeRO-3 gathers again) hit
        lookups = STEPS * MICRO * (LAYERS - 1) * 4  # forward: gate/up and down; backward: the same for dX
        assert on["stats"] == {"hits": lookups - STEPS * (LAYERS - 1) * 2, "misses": STEPS * (LAYERS - 1) * 2}
        assert on["losses"] == off["losses"], (rank, on["losses"], off["losses"])
        assert on["grads"].keys() == off["grads"].keys() and len(on["grads"]) == 2 * (LAYERS - 1)
        for name in on["grads"]:
            assert torch.equal(on["grads"][name], off["grads"][name]), (rank, name)
        for name in on["params"]:
            assert torch.equal(on["params"][name], off["params"][name]), (rank, name)
        assert all(not torch.equal(on["params"][n], p) for n, p in on["init"].items())  # the experts did train
        stale = out["stale"]["losses"]
        assert stale[:MICRO] == off["losses"][:MICRO] and stale[MICRO:] != off["losses"][MICRO:], \
            "without the step hook the second step must run on the first step's fp8 weights"
