"""`moestack train --plan P --dry-run` (moestack/train/dry_run.py): one rank of a plan at its full world size on a CPU.

Counts are checked against what the layout implies (parameter shards per rank, all-to-alls per step), a refused
plan fails with one line, and the planner's top plans of three models build at 1024+ ranks (tests/data/plans:
`moestack plan MODEL --cluster C` output at the time of writing; scripts/dry_run_top_plans.py re-searches and
dry-runs every model x cluster preset).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moestack.config.plan import load_plan, make_plan, save_plan
from moestack.config.train_spec import load_train_spec
from moestack.model.transformer import build_model
from moestack.planner.profile import load_any_model_spec
from moestack.train.dry_run import run_isolated as dry_run  # one process per played rank

REPO = Path(__file__).resolve().parents[2]
PLANS = REPO / "tests" / "data" / "plans"


def _spec(seq: int):
    return load_train_spec(None, {"seq_len": seq})


def _a2a_calls(report) -> float:
    return sum(t.calls for (kind, group), t in report.collectives.items() if kind == "alltoall_base")


@pytest.mark.slow
def test_parameter_shards_and_all_to_alls_match_the_layout():
    """EP8 x ZeRO-3 on 8 ranks, rank 5: 2 of 16 experts per layer, every dense tensor's dim-0 chunk 5 of 8 (FSDP);
    per MoE layer and micro-batch 5 all-to-alls (counts, dispatch, combine; their two backwards), 8 with the MoE
    recomputed (the rerun dispatch and combine plus its counts)."""
    model = load_any_model_spec("tiny")
    full = build_model(model, "meta")


    def chunk5(n: int) -> int:  # rows of FSDP's dim-0 chunk 5 of 8 (torch.chunk sizes, missing chunks empty)
        chunks = torch.arange(n).chunk(8)
        return len(chunks[5]) if len(chunks) > 5 else 0

    dense = sum(chunk5(p.shape[0]) * p[0].numel() for n, p in full.named_parameters() if ".experts." not in n)
    experts = sum(p.numel() // 8 for n, p in full.named_parameters() if ".experts." in n)
    moe_layers = len(full.moe_layers())
    for recompute, per in (("none", 5), ("full", 8)):
        plan = make_plan(model="tiny", cluster="h200-cluster", devices=8, seq_len=32, global_batch_size=16,
                         micro_batch_size=1, ep=8, dp_shard=8, zero_stage=3,
                         recompute={"moe": recompute})
        report = dry_run(plan, _spec(32), model, rank=5)
        assert report.param_count == {"dense": dense, "experts": experts}
        assert _a2a_calls(report) == per * moe_layers * plan.num_microbatches, report.collectives
        assert report.planner_memory and report.optimizer == 2 * 4 * (dense + experts)  # AdamW m, v in fp32
        ep_groups = {g for kind, g in report.collectives if kind == "alltoall_base"}
        assert len(ep_groups) == 1 and "ep" in ep_groups.pop().split("(")[0].split("/")


@pytest.mark.slow
def test_tiny_plan_at_4096_ranks_builds():
    plan = make_plan(model="tiny", cluster="h200-cluster", devices=4096, seq_len=32, global_batch_size=2048,
                     micro_batch_size=1, tp=2, ep=16, dp_shard=2048, zero_stage=3)
    report = dry_run(plan, _spec(32), load_any_model_spec("tiny"), rank=1, step=False)
    assert report.coords["tp"] == 1 and report.coords["ep"] == 1 and report.coords["edp"] == 0
    assert report.param_count["experts"] > 0 and report.optimizer > 0 and not report.collectives
    # rank 4095's FSDP chunks (2047 of 2048, edp 255 of 256) are empty for the tiny model's tensors: nothing held
    last = dry_run(plan, _spec(32), load_any_model_spec("tiny"), rank=4095, step=False)
    assert last.optimizer == 0 and last.param_count == {"dense": 0, "experts": 0}


def test_a_plan_the_runtime_refuses_fails_with_one_line(tmp_path):
    path = tmp_path / "plan.yaml"
    save_plan(make_plan(model="tiny", cluster="h200-cluster", devices=8, seq_len=32, global_batch_size=8, ep=2,
                        dp_shard=8, zero_stage=3, ep_token_dedup=True), path)
    proc = subprocess.run([sys.executable, "-m", "moestack", "train", "--plan", str(path), "--dry-run"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: plan.ep_token_dedup:"), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kimi-k3@h200-cluster", "deepseek-v3@h200-cluster", "qwen3-235b@h200-cluster",
                                  "kimi-k3@cloudmatrix384"])
def test_top_plans_build_at_full_size(name):
    plan = load_plan(PLANS / f"{name}.yaml")
    report = dry_run(plan, _spec(plan.seq_len), load_any_model_spec(plan.model), rank=0, step=False)
    assert report.params["dense"] + report.params["experts"] > 0 and report.optimizer > 0
    assert report.planner_memory, report.notes


@pytest.mark.slow
def test_kimi_k3_top_plan_steps_at_1024_ranks():
    """The K3 plan the planner ranks first on 1024 H200 (dualpipev, EP all-to-all overlap, hierarchical dispatch):
    one fake step of rank 0 (first and last pipeline stage), ~30 CPU-seconds."""
    plan = load_plan(PLANS / "kimi-k3@h200-cluster.yaml")
    assert plan.devices == 1024 and plan.ep_comm_overlap
    report = dry_run(plan, _spec(plan.seq_len), load_any_model_spec(plan.model), rank=0)
    groups = {g for _, g in report.collectives}
    assert {"ep_local(8)", f"pp({plan.pp})"} <= groups, groups
    a2a = sum(t.bytes for (kind, g), t in report.collectives.items() if kind == "alltoall_base")
    assert a2a > 0
