"""The FP8 weight cache (moestack/ops/fp8/weight_cache.py) under FSDP2 ZeRO-3 on 2 gloo ranks: the same training run
with the cache on (both modes) and off gives bitwise the same losses, gradients and parameters; cache mode step
(kernels.fp8.weight_cache) quantises once per weight and optimizer step, the default drops the weights FSDP frees and so
holds less at its peak. (Without the cache's optimizer-step hook the "step" run would serve the first step's fp8 weights
in the second and differ from the run without the cache: session 12's control; the hook itself is unit-tested in
tests/ops/test_fp8.py.)

FSDP2 gathers the unsharded expert weights into new storage for every forward and (ZeRO-3) backward, without moving
their version counter, and the fused optimizer update does not move it either: the cache keys on the unsharded
parameter object and is emptied at every optimizer step. Two MoE layers (their gathers may reuse each other's
storage), 2 optimizer steps of 2 micro-batches each (gradient accumulation). The experts run the FP8 GEMM strategy
(grouped_gemm.Fp8GroupedGemm; on CPU its Triton kernels in the interpreter). Before session 12 the key held the data
pointer, which changes with every gather: 1-2 hits of 16.
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
    from torch.distributed.tensor import DTensor

    from moestack.config.model_spec import ModelSpec
    from moestack.config.plan import make_plan
    from moestack.config.train_spec import OptimizerSpec
    from moestack.model.transformer import build_model
    from moestack.ops.fp8 import weight_cache as wc
    from moestack.ops.fp8.grouped_gemm import Fp8GroupedGemm
    from moestack.parallel import build_meshes, parallelize
    from moestack.train.optim import build_optimizer

    spec = small_model_spec().model_dump()
    spec.update(num_layers=LAYERS, full_attention_layers=[], dense_layers=[1])
    spec = ModelSpec.model_validate(spec)
    g = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, spec.vocab_size, (world * MICRO * ROWS, T + 1), generator=g) for _ in range(STEPS)]
    out = {}
    try:
        for cache in ("on", "step", "off"):
            wc.clear()
            wc.stats.update(hits=0, misses=0, peak_bytes=0)
            plan = make_plan(model="tiny", cluster="cpu", devices=world, seq_len=T, global_batch_size=world * ROWS,
                             micro_batch_size=ROWS, dp_shard=world, zero_stage=3)
            model = build_model(spec, "cpu", seed=0)
            moes = [b.ffn for b in model.layers.values() if b.kind.ffn == "moe"]
            assert len(moes) == LAYERS - 1
            for moe in moes:
                moe.experts.gemm = Fp8GroupedGemm(cache_mode=cache)
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
        wc.clear()
    return out


def test_fp8_weight_cache_under_fsdp2():
    if torch.cuda.is_available():
        pytest.skip("CPU ranks with the fp8 kernels in the interpreter (a GPU session has no TRITON_INTERPRET)")
    results = run_ranks(__file__, "_worker", world_size=2, timeout=900)
    for rank, out in enumerate(results):
        on, step, off = out["on"], out["step"], out["off"]
        assert off["stats"] == {"hits": 0, "misses": 0, "peak_bytes": 0}  # mode off: never consulted
        # "step": per step and weight one quantisation, the second micro-batch and every backward (ZeRO-3 gathers
        # again) hit, and the fp8 copies of both layers are held at once
        lookups = STEPS * MICRO * (LAYERS - 1) * 4  # forward: gate/up and down; backward: the same for dX
        misses = STEPS * (LAYERS - 1) * 2
        assert {k: step["stats"][k] for k in ("hits", "misses")} == {"hits": lookups - misses, "misses": misses}
        # default: a layer's copies go once FSDP frees its weights, so at most one layer's are held
        assert on["stats"]["hits"] + on["stats"]["misses"] == lookups and on["stats"]["misses"] > misses
        assert 0 < on["stats"]["peak_bytes"] <= step["stats"]["peak_bytes"] // 2, (on["stats"], step["stats"])
        for run in (on, step):
            assert run["losses"] == off["losses"], (rank, run["losses"], off["losses"])
            assert run["grads"].keys() == off["grads"].keys() and len(run["grads"]) == 2 * (LAYERS - 1)
            for name in run["grads"]:
                assert torch.equal(run["grads"][name], off["grads"][name]), (rank, name)
            for name in run["params"]:
                assert torch.equal(run["params"][name], off["params"][name]), (rank, name)
        assert all(not torch.equal(on["params"][n], p) for n, p in on["init"].items())  # the experts did train
