"""Checkpoints of a TIED model (tie_word_embeddings: true) under the layouts test_tied_resume.py does not cover: a
V-shaped pipeline (zbv: first and last stage on one rank, the stage wrapper as FSDP root), TP2 (the embedding and
the head vocab-sharded) and ZeRO-3 over two data-parallel ranks. For each, on 2 gloo ranks:
  fresh     the run from scratch has the single-process run's losses;
  resumed   the single-process run's step-2 checkpoint resumed at that layout gives the uninterrupted run's losses;
  back      the layout's own step-2 checkpoint resumed in ONE process gives them too, the tie intact.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from moestack.config.base import dump_yaml
from moestack.config.model_spec import ModelSpec
from moestack.config.plan import make_plan, save_plan
from moestack.config.train_spec import load_train_spec
from moestack.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from _dist import run_ranks, small_model_spec

SEQ, GLOBAL_BATCH, MICRO_STEPS, STEPS, SAVED_AT = 16, 4, 2, 4, 2
OPTIONS = {"seq_len": SEQ, "logging.every": 1, "logging.tensorboard": False, "logging.progress": False,
           "eval_every": 0, "data.eval_fraction": 0.0, "schedule.warmup_steps": 1, "optimizer.lr": 3e-3,
           "optimizer.grad_clip": 0.5, "checkpoint.every": SAVED_AT}
LAYOUTS = {  # name: plan fields beyond the common ones
    "zbv": {"pp": 2, "vpp": 2, "schedule": "zbv", "micro_batch_size": 1},
    "tp2": {"tp": 2, "micro_batch_size": 2},
    "zero3": {"dp_shard": 2, "zero_stage": 3, "micro_batch_size": 1},
}
REL = 2e-5  # loss agreement: other reduction orders than the single process's (fp32)


def _tied_spec() -> ModelSpec:
    return ModelSpec.model_validate({**small_model_spec().model_dump(), "tie_word_embeddings": True})


def _spec(out: str | Path, **extra):
    return load_train_spec(None, {**OPTIONS, "out_dir": str(out), "steps": STEPS, **extra})


def _layouts_worker(rank: int, world: int, model_path: str, plans: dict[str, str], root: str) -> dict:
    """Per layout: the fresh run's losses, then the single-process checkpoint (copied under <root>/<name>_resumed)
    resumed at the layout."""
    from moestack.config.base import read_yaml
    from moestack.config.plan import load_plan

    model_spec = ModelSpec.model_validate(read_yaml(model_path))
    out = {}
    for name, plan_path in plans.items():
        plan = load_plan(plan_path)
        fresh = Trainer(_spec(Path(root) / name), model_spec, log=lambda *a: None, plan=plan)
        got = {"fresh": fresh.fit()["losses"]}
        resumed = Trainer(_spec(Path(root) / f"{name}_resumed"), model_spec, log=lambda *a: None, plan=plan)
        assert resumed.resume() and resumed.step == SAVED_AT, name
        got["resumed"] = resumed.fit()["losses"]
        out[name] = got
    return out


@pytest.mark.slow
def test_tied_checkpoint_resumes_across_layouts(tmp_path, one_thread):
    model_spec = _tied_spec()
    model_path = tmp_path / "model.yaml"
    dump_yaml(model_spec, model_path)
    ref = Trainer(_spec(tmp_path / "ref", micro_batch_size=GLOBAL_BATCH // MICRO_STEPS, grad_accum_steps=MICRO_STEPS),
                  model_spec, log=lambda *a: None).fit()["losses"]
    saved = tmp_path / "ref" / "checkpoints" / f"step_{SAVED_AT:08d}"
    plans = {}
    for name, fields in LAYOUTS.items():
        shutil.copytree(saved, tmp_path / f"{name}_resumed" / "checkpoints" / saved.name)
        plans[name] = str(tmp_path / f"plan_{name}.yaml")
        save_plan(make_plan(model=str(model_path), cluster="cpu", devices=2, seq_len=SEQ,
                            global_batch_size=GLOBAL_BATCH, **fields), plans[name])
    results = run_ranks(__file__, "_layouts_worker", world_size=2, timeout=600, model_path=str(model_path),
                        plans=plans, root=str(tmp_path))

    def close(got, want, what):
        assert len(got) == len(want), (what, got, want)
        for a, b in zip(got, want, strict=True):
            assert abs(a - b) < REL * abs(b), f"{what}: losses {got} vs the uninterrupted run's {want}"

    for name in LAYOUTS:
        for rank, r in enumerate(results):
            close(r[name]["fresh"], ref, f"{name} from scratch (rank {rank})")
            close(r[name]["resumed"], ref[SAVED_AT:], f"one process -> {name} (rank {rank})")
        # the layout's own checkpoint back in one process: one parameter again, the uninterrupted run's losses
        own = tmp_path / name / "checkpoints" / f"step_{SAVED_AT:08d}"
        back = tmp_path / f"{name}_back"
        shutil.copytree(own, back / "checkpoints" / own.name)
        trainer = Trainer(_spec(back, micro_batch_size=GLOBAL_BATCH // MICRO_STEPS, grad_accum_steps=MICRO_STEPS),
                          model_spec, log=lambda *a: None)
        assert trainer.resume() and trainer.step == SAVED_AT, name
        assert trainer.model.lm_head.weight is trainer.model.embed.weight
        close(trainer.fit()["losses"], ref[SAVED_AT:], f"{name} -> one process")
