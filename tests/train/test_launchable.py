"""Every plan the search prints launches: a sample of `moestack plan tiny --devices 4` trains on 4 gloo ranks.

The sample is the top plan and the best plans of the other kinds (schedule, tp / pp / ep > 1, ZeRO stage, EP
overlap) in the ranked list, those combining most features first, SAMPLE plans in all; each runs two optimizer steps of
the real trainer (its meshes, parallelize, pipeline schedule, optimizer) and must produce finite losses. Plans the
runtime refuses never reach the list (moestack/config/support.py), which this checks from the other side.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _dist import run_ranks  # noqa: E402

from moestack.config.support import unsupported  # noqa: E402
from moestack.planner.search import Planner, load_problem  # noqa: E402

SAMPLE, SEQ, STEPS = 6, 32, 2


def _features(p) -> int:
    return (p.tp > 1) + (p.pp > 1) + (p.ep > 1) + p.ep_comm_overlap + (p.zero_stage == 3) + (p.dispatcher != "flat")


def _sample() -> list:
    """The top plan, then the best of each other (schedule, tp, pp, ep, ZeRO, overlap) kind, most features first."""
    pb = load_problem("tiny", "h200-cluster", devices=4, seq_len=SEQ, global_batch_tokens=SEQ * 64)
    ranked = [c.plan for c in Planner(pb).search({}).ranked]
    kinds = {}
    for p in ranked:
        kinds.setdefault((p.schedule, p.tp > 1, p.pp > 1, p.ep > 1, p.zero_stage, p.ep_comm_overlap), p)
    rest = sorted((p for p in kinds.values() if p is not ranked[0]), key=_features, reverse=True)
    return [ranked[0], *rest[: SAMPLE - 1]]


def _train(rank: int, world: int, plans: list, out: str) -> list:
    from moestack.config.train_spec import load_train_spec
    from moestack.planner.profile import load_any_model_spec
    from moestack.train.trainer import Trainer

    results = []
    for i, plan in enumerate(plans):
        spec = load_train_spec(None, {"out_dir": f"{out}/{i}", "steps": STEPS, "logging.progress": False,
                                      "logging.tensorboard": False, "eval_every": 0, "data.eval_fraction": 0.0,
                                      "checkpoint.save_final": False, "optimizer.lr": 1e-3})
        trainer = Trainer(spec, load_any_model_spec(plan.model), log=lambda *a, **k: None, plan=plan)
        try:
            results.append(trainer.fit()["losses"])
        finally:
            trainer.close()
    return results


@pytest.mark.slow
def test_sampled_plans_train_on_four_gloo_ranks(tmp_path):
    plans = _sample()
    assert len(plans) >= 3, [p.short() for p in plans]
    assert any(p.pp > 1 for p in plans) and any(p.ep > 1 for p in plans)
    assert all(unsupported(p) is None for p in plans)
    results = run_ranks(__file__, "_train", world_size=4, timeout=600, plans=plans, out=str(tmp_path))
    for plan, losses in zip(plans, results[0], strict=True):
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), (plan.short(), plan.schedule, losses)
