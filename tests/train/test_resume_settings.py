"""--resume applies this run's optimizer / schedule values and says which changed; refuses (one line, naming the
field) what cannot carry over; the non-finite stop's advice (lower the lr, --resume) works."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from _dist import small_model_spec  # noqa: E402

from moestack.config.train_spec import load_train_spec  # noqa: E402
from moestack.train.checkpoint import CheckpointError  # noqa: E402
from moestack.train.optim import lr_factor  # noqa: E402
from moestack.train.resume_settings import apply_resume_settings, check_resume_settings  # noqa: E402
from moestack.train.trainer import Trainer, TrainingStopped  # noqa: E402

OPTS = {"seq_len": 16, "micro_batch_size": 2, "logging.every": 1, "logging.tensorboard": False,
        "logging.progress": False, "eval_every": 0, "data.eval_fraction": 0.0, "schedule.warmup_steps": 1,
        "optimizer.lr": 3e-3, "device": "cpu", "precision": "fp32", "checkpoint.every": 2}


def _spec(out: Path, steps: int, **over):
    return load_train_spec(None, {**OPTS, "out_dir": str(out), "steps": steps, **over})


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A 2-step run with the default settings: its step-2 checkpoint is what the tests resume."""
    run = tmp_path_factory.mktemp("resume") / "run"
    Trainer(_spec(run, 2), small_model_spec(), log=lambda *a: None).fit()
    return run


def _copy(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run / "checkpoints", to / "checkpoints")
    return to


def test_new_values_apply_and_are_named(first, tmp_path):
    run = _copy(first, tmp_path / "b")
    new = {"optimizer.lr": 1e-5, "optimizer.weight_decay": 0.0, "optimizer.betas": [0.8, 0.9],
           "optimizer.eps": 1e-6, "optimizer.grad_clip": 0.25, "schedule.warmup_steps": 0,
           "schedule.decay": "constant"}
    lines = []
    tr = Trainer(_spec(run, 4, **new), small_model_spec(), log=lines.append)
    assert tr.resume() and tr.step == 2
    changed = [line for line in lines if line.startswith("resume: ")]
    assert changed == [
        "resume: optimizer.lr 0.003 -> 1e-05 (this run's value applies)",
        "resume: optimizer.betas (0.9, 0.95) -> (0.8, 0.9) (this run's value applies)",
        "resume: optimizer.eps 1e-08 -> 1e-06 (this run's value applies)",
        "resume: optimizer.weight_decay 0.1 -> 0 (this run's value applies)",
        "resume: optimizer.grad_clip 1 -> 0.25 (this run's value applies)",
        "resume: schedule.warmup_steps 1 -> 0 (this run's schedule applies)",
        "resume: schedule.decay cosine -> constant (this run's schedule applies)",
        "resume: steps 2 -> 4 (the schedule spans this run's steps)",
    ], changed
    for g in tr.optimizer.param_groups:
        assert g["lr"] == 1e-5 and g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 and g["weight_decay"] == 0.0
    tr.fit()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["train/lr"] for r in rows if "train/lr" in r]
    assert lrs == [1e-5, 1e-5], lrs  # the user's lr, not the checkpoint's schedule


def test_cosine_lr_recomputed_at_the_resumed_step(first, tmp_path):
    run = _copy(first, tmp_path / "c")
    tr = Trainer(_spec(run, 10, **{"optimizer.lr": 1e-3}), small_model_spec(), log=lambda *a: None)
    tr.resume()
    want = 1e-3 * lr_factor(2, tr.spec.schedule, 10)
    no_decay = [g for g in tr.optimizer.param_groups if g["name"] == "no_decay"]
    assert tr.scheduler.get_last_lr()[0] == want and all(g["lr"] == want for g in tr.optimizer.param_groups)
    assert all(g["weight_decay"] == 0.0 for g in no_decay)
    assert [g["weight_decay"] for g in tr.optimizer.param_groups if g["name"] == "decay"] == [0.1]


def test_unchanged_settings_say_nothing(first, tmp_path):
    run = _copy(first, tmp_path / "d")
    lines = []
    tr = Trainer(_spec(run, 2 + 1), small_model_spec(), log=lines.append)
    assert tr.resume()
    assert [x for x in lines if x.startswith("resume: ")] == ["resume: steps 2 -> 3 (the schedule spans this run's "
                                                                "steps)"]


def test_refusals_name_the_field(first, tmp_path):
    run = _copy(first, tmp_path / "e")
    with pytest.raises(CheckpointError, match=r"resume: steps: 2 is not beyond the checkpoint's step 2"):
        Trainer(_spec(run, 2), small_model_spec(), log=lambda *a: None).resume()
    extra = {"step": 2, "train_settings": {"optimizer_kind": "muon"}}
    with pytest.raises(CheckpointError, match=r"resume: optimizer: checkpoint .* holds muon state, this run builds "
                                              r"adamw.*--init-from"):
        check_resume_settings("ckpt", extra, _spec(run, 4), None)


def test_old_checkpoint_without_recorded_settings(first, tmp_path):
    """The values are compared with the loaded optimizer state; the schedule is this run's, said in one line."""
    run = _copy(first, tmp_path / "f")
    tr = Trainer(_spec(run, 4, **{"optimizer.lr": 2e-4}), small_model_spec(), log=lambda *a: None)
    tr.resume()
    tr.scheduler.base_lrs = [3e-3] * len(tr.optimizer.param_groups)  # as an old checkpoint's state loads
    for g in tr.optimizer.param_groups:
        g["lr"] = 3e-3
    lines = apply_resume_settings(tr.optimizer, tr.scheduler, {"step": 2}, tr.spec)
    assert lines[0] == "resume: optimizer.lr 0.003 -> 0.0002 (this run's value applies)"
    assert lines[-1].startswith("resume: the checkpoint does not record its schedule; this run's applies")
    assert tr.scheduler.base_lrs == [2e-4] * len(tr.optimizer.param_groups)


def test_nonfinite_stop_then_resume_with_lower_lr(tmp_path, monkeypatch):
    run = tmp_path / "nan"
    tr = Trainer(_spec(run, 5, max_bad_steps=2), small_model_spec(), log=lambda *a: None)
    real, calls = tr.model.forward, {"n": 0}

    def diverging(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * float("nan") if calls["n"] > 2 else loss

    monkeypatch.setattr(tr.model, "forward", diverging)
    with pytest.raises(TrainingStopped) as stop:
        tr.fit()
    msg = str(stop.value)
    assert "step_00000002" in msg and "--resume --lr 0.0003" in msg and "resume applies the new value" in msg
    lines = []
    again = Trainer(_spec(run, 3, max_bad_steps=2, **{"optimizer.lr": 3e-4}), small_model_spec(), log=lines.append)
    assert again.resume() and again.step == 2
    assert "resume: optimizer.lr 0.003 -> 0.0003 (this run's value applies)" in lines
    assert again.scheduler.base_lrs[0] == 3e-4
    assert len(again.fit()["losses"]) == 1


def test_cli_resume_with_lr(first, tmp_path, capsys):
    from moestack.cli.app import main
    from moestack.config.base import dump_yaml

    run = _copy(first, tmp_path / "cli")
    dump_yaml(small_model_spec(), tmp_path / "m.yaml")
    args = ["train", "--model", str(tmp_path / "m.yaml"), "--out", str(run), "--steps", "3", "--device", "cpu",
            "--precision", "fp32", "--resume", "--lr", "1e-5",
            *[f"--set={k}={v}" for k, v in OPTS.items() if k not in ("device", "precision", "optimizer.lr")]]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "resume: optimizer.lr 0.003 -> 1e-05 (this run's value applies)" in out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/lr"] for r in rows if "train/lr" in r] == [1e-5 * lr_factor(3, _spec(run, 3).schedule, 3)]
