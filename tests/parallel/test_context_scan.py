"""Context parallelism with the parallel KDA state scan (`apply_cp(..., kda_state="scan")`, plan.cp_kda = "scan") on
gloo vs one process on the whole sequence, fp64.

The op test runs `kda_scan_shard` on 4 ranks (3 compositions; shards of 12 tokens, not a multiple of the chunk) for
both forms (one widened pass, two passes) and checks outputs and every input gradient against `chunk_kda` on the
whole sequence, plus that the correction matters (the zero-state outputs are far off on ranks > 0). The model
tests run the tiny preset (KDA x3 + sparse DSA + LatentMoE) on 2 and 4 CP ranks: loss, logits, every gradient.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _dist import run_ranks
from test_context import _all_worker, _check, _ref_worker, run_cp  # noqa: F401 (_all_worker: run_ranks calls it)
from test_tensor import tiny_spec

B, T, H, K, V = 2, 48, 2, 8, 6  # K != V: a transposed state would not fit


def _op_inputs():
    g = torch.Generator().manual_seed(3)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, V)
    # log-decays from ~0 (long memory, the case where the initial state matters) to -2
    gate = -torch.rand(B, T, H, K, generator=g, dtype=torch.float64) ** 3 * 2.0
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    w = r(B, T, H, V)  # loss weights
    return [q, k, v, gate, beta], w


def _op_worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import moestack.parallel.context as ctx
    from moestack.ops.kda import chunk_kda

    inputs, w = _op_inputs()
    full = [x.clone().requires_grad_() for x in inputs]
    o_ref, _ = chunk_kda(*full, chunk_size=16)
    (o_ref * w).sum().backward()
    T_l = T // world_size
    sl = slice(rank * T_l, (rank + 1) * T_l)
    cp = ctx.CPInfo(init_device_mesh("cpu", (world_size,)))
    out = {"ref_o": o_ref[:, sl].detach(), "ref_grads": [x.grad[:, sl] for x in full]}
    with torch.no_grad():
        out["zero_state_o"], _ = chunk_kda(*[x[:, sl] for x in inputs], chunk_size=16)
    saved = ctx.KDA_SCAN_MAX_VALUE_WIDTH
    for form, width in (("widened", saved), ("two_pass", 0)):
        ctx.KDA_SCAN_MAX_VALUE_WIDTH = width
        try:
            local = [x[:, sl].clone().requires_grad_() for x in inputs]
            o = ctx.kda_scan_shard(*local, cp, chunk_size=16)
            (o * w[:, sl]).sum().backward()
        finally:
            ctx.KDA_SCAN_MAX_VALUE_WIDTH = saved
        out[form] = {"o": o.detach(), "grads": [x.grad for x in local]}
    return out


def test_kda_scan_op_matches_whole_sequence_on_4_ranks():
    results = run_ranks(__file__, "_op_worker", world_size=4, timeout=120)
    names = ("q", "k", "v", "g", "beta")
    for rank, r in enumerate(results):
        scale = r["ref_o"].norm()
        if rank > 0:  # the initial state matters here, so the test can tell a wrong scan from a right one
            assert (r["zero_state_o"] - r["ref_o"]).norm() > 1e-2 * scale, rank
        for form in ("widened", "two_pass"):
            got = r[form]
            err = float((got["o"] - r["ref_o"]).norm() / scale)
            assert err < 1e-13, (rank, form, err)
            for name, gg, gr in zip(names, got["grads"], r["ref_grads"]):
                gerr = float((gg - gr).norm() / gr.norm())
                assert gerr < 1e-12, (rank, form, name, gerr)
                assert gr.abs().sum() > 0


def test_cp4_scan_matches_single_process():
    """4 ranks of 8 tokens (half a KDA chunk); seed 1 as in test_context's CP4 test (a near-tied top-k key)."""
    results = run_cp(__file__, "_all_worker", 4, {"tiny": {"spec": tiny_spec(), "seed": 1, "kda_state": "scan"}})
    _check(results["tiny"])


def test_planner_charges_scan_and_relay_separately():
    """The scan's exposed CP time (widened pass, transition gather, correction) grows slowly with cp; the relay's
    grows with cp - 1 shards of recurrence. The plan field reaches the cost model (and its cache key)."""
    from moestack.config.cluster import load_cluster_spec
    from moestack.config.plan import make_plan
    from moestack.planner.calibration import load_calibration
    from moestack.planner.cost.compute import kda_scan_widen_factor
    from moestack.planner.cost.step import CostModel
    from moestack.planner.profile import load_any_model_spec, profile_model

    assert 1.5 < kda_scan_widen_factor(128, 64) < 2.0
    spec, seq = load_any_model_spec("proxy"), 16384
    cm = CostModel(spec, load_cluster_spec("h200-cluster").with_devices(8), load_calibration(), seq,
                   profile_model(spec, seq).train_flops_per_token)
    base = {"model": "proxy", "cluster": "h200-cluster", "devices": 8, "seq_len": seq, "global_batch_size": 8}
    comm = {(cp, mode): cm.evaluate(make_plan(**base, cp=cp, dp_shard=8 // cp, zero_stage=3, ep=8,
                                              cp_kda=mode)).time["cp_comm"]
            for cp in (2, 4, 8) for mode in ("relay", "scan")}
    assert all(v > 0 for v in comm.values()), comm
    assert comm[4, "scan"] < comm[4, "relay"] and comm[8, "scan"] < comm[8, "relay"], comm
    assert comm[8, "relay"] / comm[2, "relay"] > 5 > comm[8, "scan"] / comm[2, "scan"], comm


def _cp_tp_worker(rank: int, world_size: int, configs: dict, refs: dict) -> dict:
    """CP2 x TP2 (sequence parallel) on a (cp, tp) mesh: my tokens are a quarter of the sequence, my heads half.
    Then the single-process references this rank was given (test_context's)."""
    import torch.distributed as dist
    from test_context import _batch, _run, _seeded_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from moestack.parallel.context import apply_cp
    from moestack.parallel.tensor import apply_tp

    out = {}
    for name, kw in configs.items():
        spec, seed = kw["spec"], kw["seed"]
        model = _seeded_model(spec, seed, dense_dsa=False)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
        apply_tp(model, mesh["tp"], sequence_parallel=True)
        apply_cp(model, mesh["cp"], seq_shard_group=mesh["cp", "tp"]._flatten("cp_tp").get_group(),
                 kda_state=kw["kda_state"])
        r = {}
        _run(model, *_batch(spec, seed), "cp", r)
        grads = {}
        for n, p in model.named_parameters():  # CP shares add up over cp; TP shards gathered
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(local, group=mesh["cp"].get_group())
            grads[n] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        r["cp_grads"] = grads
        out[name] = r
    out["refs"] = {key: _ref_worker(**kw) for key, (owner, kw) in refs.items() if owner == rank}
    return out


def test_cp2_tp2_matches_single_process():
    """Context x tensor parallelism on 4 ranks, both KDA state modes, vs one process (fp64, same gates)."""
    for mode in ("scan", "relay"):
        results = run_cp(__file__, "_cp_tp_worker", 4, {"tiny": {"spec": tiny_spec(), "seed": 1, "kda_state": mode}})
        _check(results["tiny"])


def test_cp2_scan_kda_sparse_dsa_moe_matches_single_process():
    """Also with the KDA layers recomputed in backward (scan mode only: its collectives rerun on every rank in the
    same order; the relay's recompute would wait for a state the previous rank sends only in its own backward)."""
    configs = {"tiny": {"spec": tiny_spec(), "kda_state": "scan"},
               "recompute": {"spec": tiny_spec(), "kda_state": "scan", "recompute_kda": "full"}}
    results = run_cp(__file__, "_all_worker", 2, configs)
    for name in configs:
        _check(results[name])
