"""The trainer resumes bitwise with the optimizers whose stochastic rounding draws noise (bf16 m, v): a run stopped
after its step-2 checkpoint and resumed gives the uninterrupted run's losses exactly (CPU, one-rank plan on gloo),
with the rounding noise's state carried by the checkpoint (moestack.memory.adamw.RoundingStateMixin)."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

from moestack.config.plan import make_plan
from moestack.config.train_spec import load_train_spec
from moestack.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from _dist import small_model_spec

SEQ, BATCH, STEPS, SAVED_AT = 16, 4, 4, 2  # 2 steps before the checkpoint, 2 resumed
OPTIONS = {"seq_len": SEQ, "micro_batch_size": BATCH, "logging.every": 1, "logging.tensorboard": False,
           "logging.progress": False, "eval_every": 0, "data.eval_fraction": 0.0, "schedule.warmup_steps": 1,
           "optimizer.lr": 3e-3}


@pytest.fixture
def restore_environ():
    """The one-rank plan sets RANK, MASTER_PORT, ... for its gloo group; leave the environment as it was."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _run(out: Path, plan, every: int, stop: int = STEPS, resume: bool = False) -> tuple[list[float], Trainer]:
    spec = load_train_spec(None, {**OPTIONS, "out_dir": str(out), "steps": STEPS, "checkpoint.every": every})
    trainer = Trainer(spec, small_model_spec(), log=lambda *a: None, plan=plan)
    trainer.spec.steps = stop  # the schedule was built for STEPS
    try:
        if resume:
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*rounding noise restarts")
                assert trainer.resume() and trainer.step == SAVED_AT
        return trainer.fit()["losses"], trainer
    finally:
        trainer.close()


@pytest.mark.parametrize("offload", [False, True], ids=["adamw_bf16", "adamw_bf16_offload"])
def test_resume_with_bf16_optimizer_states_is_bitwise(tmp_path, restore_environ, offload):
    plan = make_plan(model="tiny", cluster="cpu", devices=1, seq_len=SEQ, global_batch_size=BATCH,
                     micro_batch_size=BATCH, optimizer="adamw_bf16", offload={"optimizer": offload})
    full, trainer = _run(tmp_path / "a", plan, every=0)
    expected = "HostOffloadAdamW" if offload else "AdamWBF16"
    assert type(trainer.optimizer).__name__ == expected

    _run(tmp_path / "b", plan, every=SAVED_AT, stop=SAVED_AT)  # stops after step 2, as a crash would
    rest, _ = _run(tmp_path / "b", plan, every=SAVED_AT, resume=True)
    assert rest == full[SAVED_AT:], (rest, full[SAVED_AT:])  # bit-identical on CPU
