"""Planner memory and DP communication of the split-backward V schedules (zbv, dualpipev) under FSDP / ZeRO.

The trainer makes each zbv / dualpipev stage the FSDP root (moestack.parallel.pipeline.stage_module): the stage's
parameters stay gathered (ZeRO-3's reshard-after-forward off) and its gradients unsharded for the whole step, and
are reduce-scattered once per step. So ZeRO-3 holds the bf16 compute copy of all the stage's parameters next to
its fp32 shards, and ZeRO-2 / 3 hold whole fp32 gradients. Expected bytes here come from profile.py's parameter
counts (the single source of parameter counts) and the dtype sizes, not from the cost model's memory code.
"""

from __future__ import annotations

import pytest

from moestack.config.cluster import GIB, load_cluster_spec
from moestack.config.plan import make_plan
from moestack.planner.calibration import load_calibration
from moestack.planner.cost.step import CostModel
from moestack.planner.profile import load_any_model_spec, profile_model
from moestack.planner.report import breakdown

SEQ, DEVICES, PP, SHARD = 4096, 16, 2, 8  # pp2 x dp_shard 8: ep 1, so experts shard over the same 8 ranks
FP32_B, BF16_B = 4, 2
# the 1f1b ZeRO-3 plan's terms computed before the V-schedule change (commit 17930a2's cost.py), GiB: unchanged
ONE_F_ONE_B_BEFORE = {"weights": 0.9508, "gradients": 0.9508, "buffers": 1.2321}


@pytest.fixture(scope="module")
def setup():
    spec = load_any_model_spec("proxy")
    prof = profile_model(spec, SEQ)
    cm = CostModel(spec, load_cluster_spec("h200-cluster").with_devices(DEVICES), load_calibration(), SEQ,
                     prof.train_flops_per_token)
    return spec, prof, cm


def _plan(schedule: str, zero: int, gbs: int = 64):
    return make_plan(model="proxy", cluster="h200-cluster", devices=DEVICES, seq_len=SEQ, global_batch_size=gbs,
                     pp=PP, vpp=1 if schedule == "1f1b" else 2, schedule=schedule, dp_shard=SHARD, zero_stage=zero)


def _rank_params(prof, spec, layout) -> list[int]:
    """Parameters each pipeline rank holds: its chunks' layers, the embedding with the first chunk and the head
    with the last (proxy is untied)."""
    assert not spec.tie_word_embeddings
    out = [0] * PP
    for layers, rank in zip(layout.chunks, layout.chunk_rank):
        out[rank] += sum(prof.layers[i].params for i in layers)
    out[layout.chunk_rank[0]] += prof.embedding_params
    out[layout.chunk_rank[-1]] += prof.head_params
    return out


def _busiest(params: list[int], gradients: float, per_param: float) -> int:
    """The parameter count of the rank the cost model reports (the one whose gradients it shows)."""
    hits = [n for n in params if gradients == pytest.approx(n * per_param, rel=1e-5)]
    assert len(hits) == 1, (params, gradients / per_param)
    return hits[0]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedule_zero3_holds_gathered_params_and_whole_grads(setup, schedule):
    spec, prof, cm = setup
    base, v = cm.evaluate(_plan("1f1b", 3)), cm.evaluate(_plan(schedule, 3))

    # 1f1b, ZeRO-3 as before: fp32 parameter and gradient shards, 1/8 each
    p1 = _busiest(_rank_params(prof, spec, base.layout), base.memory["gradients"], FP32_B / SHARD)
    assert base.memory["weights"] == pytest.approx(p1 * FP32_B / SHARD, rel=1e-5)
    for key, gib in ONE_F_ONE_B_BEFORE.items():
        assert base.memory[key] / GIB == pytest.approx(gib, abs=1e-4), key

    # V schedule: fp32 shards + the whole bf16 gathered copy; whole fp32 gradients
    pv = _busiest(_rank_params(prof, spec, v.layout), v.memory["gradients"], FP32_B)
    assert v.memory["weights"] == pytest.approx(pv * (FP32_B / SHARD + BF16_B), rel=1e-5)
    expected_delta = pv * (FP32_B / SHARD + BF16_B + FP32_B) - p1 * (FP32_B / SHARD + FP32_B / SHARD)
    got_delta = (v.memory["weights"] + v.memory["gradients"]) - (base.memory["weights"] + base.memory["gradients"])
    assert got_delta == pytest.approx(expected_delta, rel=1e-5)
    assert got_delta > 0.5 * pv * (BF16_B + FP32_B)  # a large rise, not a rounding

    # ZeRO-3's per-layer gather buffers (2 layers in bf16) are gone: every layer is in the held copy
    without = cm.evaluate(_plan(schedule, 2))  # same layout, no gather buffers
    assert without.layout.chunks == v.layout.chunks
    assert v.memory["buffers"] == pytest.approx(without.memory["buffers"], rel=1e-9)

    # the memory report says why
    assert any("parameters gathered, gradients unsharded" in line for line in breakdown(v))
    assert not any("gathered" in line or "unsharded" in line for line in breakdown(base))

    # the search's lower bound stays below the evaluated memory
    assert cm.memory_lower_bound(_plan(schedule, 3))[0] <= v.memory_total


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedule_zero2_holds_whole_grads(setup, schedule):
    spec, prof, cm = setup
    z2, z1 = cm.evaluate(_plan(schedule, 2)), cm.evaluate(_plan(schedule, 1))
    pv = _busiest(_rank_params(prof, spec, z2.layout), z2.memory["gradients"], FP32_B)
    assert z2.memory["gradients"] == pytest.approx(z1.memory["gradients"], rel=1e-9)  # ZeRO-2 grads as ZeRO-1
    assert z2.memory["gradients"] == pytest.approx(pv * FP32_B, rel=1e-5)
    assert any("gradients unsharded" in line for line in breakdown(z2))


@pytest.mark.parametrize("zero", [2, 3])
def test_v_schedule_dp_comm_once_per_step(setup, zero):
    """zbv reduces (and, ZeRO-3, gathers) once per step: DP traffic does not grow with the micro-batches; 1f1b's
    ZeRO-2 / 3 traffic does (one reduce-scatter per micro-batch)."""
    _, _, cm = setup
    for schedule, grows in (("zbv", False), ("1f1b", True)):
        few, many = cm.evaluate(_plan(schedule, zero, gbs=32)), cm.evaluate(_plan(schedule, zero, gbs=128))
        assert many.plan.num_microbatches == 4 * few.plan.num_microbatches
        if grows:
            assert many.time["dp_comm"] > 2 * few.time["dp_comm"]
        else:
            assert many.time["dp_comm"] == pytest.approx(few.time["dp_comm"], rel=1e-9)
