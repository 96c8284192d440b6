"""TP x EP through `parallelize` with bf16 compute (FSDP2 mixed precision, the GPU setting) on 2 gloo ranks.

With param_dtype bf16, FSDP shards each MoE router on its own (fp32 policy), and FSDP's pre-forward unshard of the
router ran after the MoE's TP parameter swap, handing the router a DTensor weight ("aten.mm got mixed
torch.Tensor and DTensor", first seen on two H200s). The run must work and track the fp32 single-process loss.
This is a reduced-precision smoke test (the exact TP x EP comparison is test_tensor.py's, in fp64): the bf16 loss
measured 1.9e-5 from the fp32 one (x86, torch 2.13 CPU); the bound is bf16's unit roundoff, 2^-9 ~ 2e-3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _dist import run_ranks

B, T = 2, 32


def _worker(rank: int, world: int) -> dict:
    from moestack.config.model_spec import load_model_spec
    from moestack.config.plan import make_plan
    from moestack.model.transformer import build_model
    from moestack.parallel import build_meshes, parallelize

    spec = load_model_spec("tiny")
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    ref = build_model(spec, "cpu", seed=0)
    ref_loss = float(ref(tokens, targets))
    plan = make_plan(model="tiny", cluster="cpu", devices=world, seq_len=T, global_batch_size=B, micro_batch_size=B,
                     tp=2, ep=2, zero_stage=0)
    meshes = build_meshes(plan, "cpu")
    model = parallelize(build_model(spec, "cpu", seed=0), plan, meshes, param_dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, targets)
    loss.backward()
    router = next(iter(model.moe_layers().values())).router.weight
    grad = router.grad.full_tensor() if hasattr(router.grad, "full_tensor") else router.grad
    return {"loss": float(loss), "ref": ref_loss, "router_grad_finite": bool(torch.isfinite(grad).all()),
            "router_grad_norm": float(grad.float().norm())}


def test_tp2_ep2_bf16_compute_runs_and_tracks_fp32_loss():
    out = run_ranks(__file__, "_worker", 2, timeout=300)
    for r in out:
        assert abs(r["loss"] - r["ref"]) / r["ref"] < 2e-3, r
        assert r["router_grad_finite"] and r["router_grad_norm"] > 0, r
    assert out[0]["loss"] == out[1]["loss"]
