"""Hot-expert replication plans (planner/eplb.py) and their price in the cost model."""

from __future__ import annotations

import random

import pytest

from moestack.config.base import ConfigError
from moestack.config.cluster import load_cluster_spec
from moestack.config.plan import make_plan
from moestack.planner.calibration import load_calibration
from moestack.planner.cost.compute import moe_time_imbalance
from moestack.planner.cost.step import CostModel
from moestack.planner.eplb import max_over_mean, plan_replicas, rank_loads, replicated_imbalance, zipf_load
from moestack.planner.profile import load_any_model_spec, profile_model


@pytest.mark.parametrize("E,ep,slots,seed", [(64, 8, 2, 0), (32, 4, 1, 1), (96, 8, 3, 2), (16, 16, 1, 3)])
def test_plan_is_valid_and_lowers_the_busiest_rank(E, ep, slots, seed):
    rng = random.Random(seed)
    load = [rng.paretovariate(1.2) for _ in range(E)]
    X = E // ep
    plan = plan_replicas(load, ep, slots)
    assert len(plan) == ep and all(len(s) <= slots for s in plan)
    for r, experts in enumerate(plan):
        assert len(set(experts)) == len(experts)
        assert all(e // X != r for e in experts)  # never a copy on the owner
    before = rank_loads(load, ep, [[] for _ in range(ep)])
    after = rank_loads(load, ep, plan)
    assert sum(after) == pytest.approx(sum(load)) == pytest.approx(sum(before))
    assert max(after) < max(before)
    # each placement lowered the busiest rank: no rank ends above the old maximum
    assert max_over_mean(after) <= max_over_mean(before)


def test_plan_leaves_balanced_load_alone():
    assert plan_replicas([5.0] * 16, 4, 2) == [[], [], [], []]


def test_zipf_on_8_ranks_reaches_the_target():
    load = zipf_load(64, 1.2)
    before = max_over_mean(rank_loads(load, 8, [[] for _ in range(8)]))
    after = max_over_mean(rank_loads(load, 8, plan_replicas(load, 8, 2)))
    assert before > 2.0 and after <= 1.15, (before, after)


def test_replicated_imbalance_model():
    assert replicated_imbalance(1.4, 128, 8, 0) == 1.4
    assert replicated_imbalance(1.0, 128, 8, 2) == 1.0
    one, two = replicated_imbalance(1.6, 128, 8, 1), replicated_imbalance(1.6, 128, 8, 2)
    assert 1.0 <= two <= one < 1.6


def _model(devices=8, seq=4096):
    spec = load_any_model_spec("proxy")
    cl = load_cluster_spec("h200-cluster").with_devices(devices)
    return CostModel(spec, cl, load_calibration(), seq, profile_model(spec, seq).train_flops_per_token)


def _plan(**kw):
    base = dict(model="proxy", cluster="h200-cluster", devices=8, seq_len=4096, global_batch_size=64,
                dp_shard=8, zero_stage=1, ep=8, micro_batch_size=8)  # device-bound, not host-launch-bound
    return make_plan(**{**base, **kw})


def test_cost_model_prices_imbalance_and_replication():
    cm = _model()
    even = cm.evaluate(_plan(moe_load_imbalance=1.0))
    base = cm.evaluate(_plan())  # the default 1.1
    skewed = cm.evaluate(_plan(moe_load_imbalance=2.0))
    replicated = cm.evaluate(_plan(moe_load_imbalance=2.0, ep_replicas=2))
    assert even.step_time_s < base.step_time_s < skewed.step_time_s
    assert replicated.step_time_s < skewed.step_time_s
    assert moe_time_imbalance(replicated.plan, cm.spec) < 1.3


def test_plan_validates_replication():
    with pytest.raises(ConfigError, match="ep_replicas"):
        _plan(ep=1, ep_replicas=2)
    with pytest.raises(ConfigError, match="moe_load_imbalance"):
        _plan(moe_load_imbalance=0.9)
