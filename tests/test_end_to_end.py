"""End to end on the tiny preset: the loss falls, resume is exact, bad checkpoints and NaNs are handled."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from moestack.cli.app import main
from moestack.config import load_model_spec, load_train_spec
from moestack.train.trainer import Trainer, TrainingStopped

FAST = {
    "micro_batch_size": 4,
    "seq_len": 32,
    "eval_every": 0,
    "eval_batches": 1,
    "logging.every": 1,
    "logging.tensorboard": False,
    "logging.progress": False,
    "schedule.warmup_steps": 2,
}


def make_trainer(tmp_path, **overrides) -> Trainer:
    spec = load_train_spec(None, {**FAST, "out_dir": str(tmp_path / "run"), **overrides})
    return Trainer(spec, load_model_spec("tiny"), log=lambda *_: None)


def test_loss_falls_on_tiny(tmp_path):
    trainer = make_trainer(tmp_path, steps=20, **{"optimizer.lr": 3e-3, "checkpoint.every": 0})
    losses = trainer.fit()["losses"]  # the first / last 5 steps' means fall by ~1.9 in 20 steps (~2.6 in 40)
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)
    # the router bias moved (aux-loss-free balancing ran) and stayed finite
    biases = [m.router.selection_bias for m in trainer.model.moe_layers().values()]
    assert all(torch.isfinite(b).all() and b.abs().sum() > 0 for b in biases)


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = make_trainer(tmp_path / "a", steps=6, **{"checkpoint.every": 0}).fit()["losses"]

    first = make_trainer(tmp_path / "b", steps=6, **{"checkpoint.every": 3})
    # stop after 3 steps, as a crash would: only the step-3 checkpoint survives
    first.spec.steps = 3
    first.fit()
    resumed = make_trainer(tmp_path / "b", steps=6, **{"checkpoint.every": 3})
    assert resumed.resume()
    assert resumed.step == 3
    rest = resumed.fit()["losses"]
    assert rest == full[3:], (rest, full[3:])  # bit-identical on CPU


def test_corrupt_or_partial_checkpoint_refused_by_cli(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--steps", "2", "--out", str(out), "-q", "--batch-size", "2", "--seq-len", "16",
            "--set", "logging.tensorboard=false", "--set", "eval_every=0"]
    assert main(args) == 0
    ckpt = out / "checkpoints" / "step_00000002"
    assert ckpt.is_dir()
    # corrupt one byte of a checkpoint file
    victim = max((p for p in ckpt.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    assert main([*args, "--steps", "4", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "step_00000002" in err and "\n" not in err.strip()
    # a partial checkpoint (no completion marker) is never picked as the newest one
    shutil.rmtree(ckpt)
    (out / "checkpoints" / ".tmp_step_00000003").mkdir(parents=True)
    assert main([*args, "--steps", "1", "--resume"]) == 0
    assert "no checkpoint" in capsys.readouterr().out


def test_nonfinite_steps_are_skipped_then_stop(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, steps=8, max_bad_steps=2, **{"checkpoint.every": 2})
    real_forward = trainer.model.forward
    calls = {"n": 0}

    def flaky_forward(*args, **kwargs):
        calls["n"] += 1
        loss = real_forward(*args, **kwargs)
        # step 3 is non-finite once (skipped), from step 5 on always (run stops)
        return loss * float("nan") if calls["n"] == 3 or calls["n"] >= 6 else loss

    monkeypatch.setattr(trainer.model, "forward", flaky_forward)
    with pytest.raises(TrainingStopped, match=r"2 consecutive non-finite steps.*last good checkpoint: .*step_00000004"):
        trainer.fit()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(1 for x in lines if x.get("train/skipped_nonfinite")) == 3
    assert trainer.step == 4


def test_bad_user_input_is_one_line(tmp_path, capsys):
    assert main(["train", "--model", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "neither a preset" in err and "\n" not in err
    assert main(["train", "--seq-len", "100000", "--out", str(tmp_path), "-q"]) == 2
    assert "max_seq_len" in capsys.readouterr().err
