"""Parallel folding arithmetic (no processes): the dense and expert meshes tile the same ranks, EP groups are
blocks of consecutive ranks inside one pipeline stage, hierarchical domains split each EP group, bad degrees fail
with one line. (The DeviceMesh groups themselves are checked against this layout on 4 ranks in test_fsdp.py.)"""

from __future__ import annotations

import pytest

from moestack.config.base import ConfigError
from moestack.config.plan import make_plan
from moestack.parallel import build_meshes, check_supported, mesh_layout


def _plan(**kw):
    base = dict(model="tiny", cluster="cpu", seq_len=64, global_batch_size=64)
    return make_plan(**{**base, **kw})


LAYOUTS = [
    dict(devices=8, dp_shard=8, zero_stage=3, ep=8),
    dict(devices=16, pp=2, dp_shard=4, tp=2, zero_stage=3, ep=4),
    dict(devices=16, dp_replicate=2, dp_shard=4, tp=2, zero_stage=3, ep=2),
    dict(devices=12, pp=3, dp_replicate=2, tp=2, ep=2),
]


@pytest.mark.parametrize("kw", LAYOUTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_dense_and_expert_meshes_fold_onto_the_same_ranks(kw):
    plan = _plan(**kw)
    lay = mesh_layout(plan)
    assert lay.dense.shape == (plan.pp, plan.dp_replicate, plan.dp_shard, plan.cp, plan.tp)
    assert lay.experts.shape == (plan.pp, plan.edp, plan.ep, plan.etp)
    for stage in range(plan.pp):  # each pipeline stage: the same set of ranks in both views
        dense = set(lay.dense[stage].reshape(-1).tolist())
        experts = set(lay.experts[stage].reshape(-1).tolist())
        assert dense == experts and len(dense) == plan.devices // plan.pp
    # an EP group is ep consecutive ranks (one node / fast domain when ep <= ranks per domain)
    for group in lay.experts.permute(0, 1, 3, 2).reshape(-1, plan.ep):
        assert group.tolist() == list(range(int(group[0]), int(group[0]) + plan.ep * plan.etp, plan.etp))
    # every rank is in exactly one EP group and one edp group
    assert sorted(lay.experts.reshape(-1).tolist()) == list(range(plan.devices))


def test_tp_ranks_are_the_fastest_dim_and_pp_the_slowest():
    plan = _plan(devices=16, pp=2, dp_shard=4, tp=2, zero_stage=3, ep=4)
    lay = mesh_layout(plan)
    assert lay.dense[0, 0, 0, 0].tolist() == [0, 1]  # a TP group: adjacent ranks
    assert lay.dense[1].min() == 8  # stage 1 is the second half
    assert lay.experts[0, 1].reshape(-1).tolist() == [4, 5, 6, 7]  # second EP group of stage 0


def test_hierarchical_domains_split_each_ep_group():
    plan = _plan(devices=8, dp_shard=8, zero_stage=3, ep=8, dispatcher="hierarchical")
    lay = mesh_layout(plan, ep_domain_size=4)
    assert lay.hier.shape == (1, 1, 2, 4, 1)
    assert lay.hier[0, 0, :, :, 0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # domains of consecutive ranks
    assert lay.hier[0, 0, :, 1, 0].tolist() == [1, 5]  # a cross-domain group: same local index
    with pytest.raises(ConfigError, match="must divide ep"):
        mesh_layout(plan, ep_domain_size=3)


def test_unsupported_degrees_fail_with_one_line():
    with pytest.raises(ConfigError, match="context parallelism"):
        check_supported(_plan(devices=4, cp=2, pp=2))
    check_supported(_plan(devices=4, cp=2, tp=2))  # CP x TP is supported
    with pytest.raises(ConfigError, match="recompute.kda"):
        check_supported(_plan(devices=2, cp=2, recompute={"kda": "full"}))
    check_supported(_plan(devices=2, cp=2, recompute={"kda": "full"}, cp_kda="scan"))  # the scan reruns collectives
    check_supported(_plan(devices=4, dp_shard=4, zero_stage=3, ep=2, etp=2))  # expert TP is supported
    with pytest.raises(ConfigError, match="not initialised"):
        build_meshes(_plan(devices=2, dp_shard=2, zero_stage=3))
