"""Every Plan field the cost model reads is one the runtime reads: the planner prices nothing the trainer ignores.

The plan is a Plan subclass that records which module reads each field. For a few plans covering the features
(pipeline schedules with the EP overlap, CP with the KDA scan, hierarchical dispatch with dedup, ETP, ZeRO stages,
recompute and offload policies, Muon, the FP8 recipe), the fields that moestack.planner reads in
`CostModel.evaluate` / `memory_lower_bound` must be a subset of those the runtime reads while building and
stepping the plan (`moestack train --dry-run`: trainer, parallel, memory, model; not the dry run's own report and
not moestack.config.support, whose refusing is not honouring). Exception: a field whose only runnable value is its
default (DEFAULT_ONLY), checked the other way round: support.py refuses it at every other value.
"""

from __future__ import annotations

import sys
import typing
from collections import defaultdict

import pytest

from moestack.config.plan import OffloadPolicy, Plan, RecomputePolicy
from moestack.config.support import unsupported

_READS: dict[str, set[str]] = defaultdict(set)
_FIELDS = set(Plan.model_fields)
SKIP_FRAMES = ("moestack.config.plan", "pydantic", "tests.", "test_plan_fields")
RUNTIME = ("moestack.train", "moestack.parallel", "moestack.memory", "moestack.model", "moestack.ops")
NOT_RUNTIME = ("moestack.train.dry_run",)
DEFAULT_ONLY = {"ep_dispatch_dtype"}  # priced for published runs, refused by the runtime unless the default


class TrackedPlan(Plan):
    def __getattribute__(self, name: str):
        if name in _FIELDS:
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith(SKIP_FRAMES):
                frame = frame.f_back
            _READS[frame.f_globals.get("__name__", "?") if frame is not None else "?"].add(name)
        return super().__getattribute__(name)


def _reads(prefixes: tuple[str, ...], exclude: tuple[str, ...] = ()) -> set[str]:
    return {f for mod, fields in _READS.items() if mod.startswith(prefixes) and not mod.startswith(exclude)
            for f in fields}


BASE = dict(model="tiny", cluster="h200-cluster", devices=8, seq_len=64)
PLANS = {
    "pp_dualpipev_overlap": dict(pp=2, vpp=2, schedule="dualpipev", tp=2, ep=2, dp_shard=2, zero_stage=3,
                                 global_batch_size=8, ep_comm_overlap=True, shared_expert_overlap=True,
                                 tp_grad_reduce="deferred", offload=OffloadPolicy(optimizer=True),
                                 recompute=RecomputePolicy(kda="selective", moe="full")),
    "cp_scan_hier_dedup_muon": dict(cp=2, tp=2, dp_shard=2, zero_stage=1, ep=4, global_batch_size=4,
                                    dispatcher="hierarchical", ep_token_dedup=True, cp_kda="scan",
                                    recompute=RecomputePolicy(kda="full", attention="selective"),
                                    offload=OffloadPolicy(activations=True), optimizer="muon", precision="fp8"),
    "pp_interleaved_etp": dict(pp=2, vpp=2, schedule="interleaved_1f1b", tp=2, ep=2, etp=2, dp_shard=2,
                               zero_stage=2, global_batch_size=8, ep_send_order="largest_first",
                               optimizer="adamw_bf16"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_cost_model_reads_only_what_the_runtime_reads(name):
    from moestack.config.train_spec import load_train_spec
    from moestack.planner.profile import load_any_model_spec
    from moestack.planner.search import load_problem
    from moestack.train.dry_run import dry_run

    plan = TrackedPlan(**BASE, **PLANS[name])
    assert unsupported(plan) is None
    _READS.clear()
    pb = load_problem(plan.model, plan.cluster, plan.devices, plan.seq_len, None, None, plan.precision,
                      plan.optimizer)
    pb.cost.evaluate(plan)
    pb.cost.memory_lower_bound(plan)
    priced = _reads(("moestack.planner",))
    _READS.clear()
    spec = load_train_spec(None, {"seq_len": plan.seq_len})
    dry_run(plan, spec, load_any_model_spec(plan.model), rank=1)
    consumed = _reads(RUNTIME, NOT_RUNTIME)
    assert priced, "the tracking saw no cost-model reads"
    forced = {"schedule", "vpp"} if plan.pp == 1 else set()  # the Plan validator fixes them (1f1b, 1) at pp 1
    missing = priced - consumed - DEFAULT_ONLY - forced
    assert not missing, f"{name}: the cost model prices {sorted(missing)}, which the runtime never reads"


def test_default_only_fields_are_refused_otherwise():
    plan = Plan(**BASE, **PLANS["pp_interleaved_etp"])
    for field in DEFAULT_ONLY:
        default = Plan.model_fields[field].default
        for value in typing.get_args(Plan.model_fields[field].annotation):
            if value != default:
                assert unsupported(plan.model_copy(update={field: value})), f"{field}={value!r} is not refused"
