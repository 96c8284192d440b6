"""Metrics: JSON-lines log, TensorBoard events, loss-curve PNG, expert-load summary."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from moestack.train.metrics import MetricsLogger, format_expert_load, plot_loss_curve, read_metrics


def test_jsonl_tensorboard_and_png(tmp_path):
    gen = torch.Generator().manual_seed(0)
    losses = (torch.rand(12, generator=gen) + 2).tolist()
    log = MetricsLogger(tmp_path / "run", tensorboard=True)
    for step, loss in enumerate(losses, start=1):
        log.log(step, {"loss": loss, "lr": torch.tensor(1e-3 * step)})
        if step % 4 == 0:
            log.log(step, {"loss": loss + 0.5}, prefix="eval")
    log.log(13, {"loss": float("nan")})
    log.close()

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 12 + 3 + 1
    records = [json.loads(line) for line in lines]  # strict JSON: NaN is written as null
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 14))
    assert [r["train/loss"] for r in train[:-1]] == pytest.approx(losses)
    assert train[-1]["train/loss"] is None
    assert train[2]["train/lr"] == pytest.approx(3e-3)
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evals] == [4, 8, 12] and evals[0]["eval/loss"] == pytest.approx(losses[3] + 0.5)
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))

    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 14, "train/lo')  # torn line from a crash
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 16
    png = plot_loss_curve(tmp_path / "run" / "metrics.jsonl", tmp_path / "plots" / "loss.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_missing_tensorboard_warns_and_continues(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.warns(UserWarning, match="TensorBoard logging off"):
        log = MetricsLogger(tmp_path, tensorboard=True)
    log.log(1, {"loss": 2.0})
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["train/loss"] == 2.0
    assert not (tmp_path / "tb").exists()


def test_format_expert_load():
    gen = torch.Generator().manual_seed(1)
    counts = torch.randint(1, 50, (16,), generator=gen)
    counts[[3, 7, 11]] = 0
    even = torch.full((8,), 5)
    text = format_expert_load({"layers.1.moe": counts, "layers.2.moe": even, "layers.3.moe": torch.zeros(4)})
    lines = text.splitlines()
    assert len(lines) == 3
    mean = counts.double().mean().item()
    assert lines[0] == (f"layers.1.moe: max/mean {counts.max().item() / mean:.2f}  min/mean 0.00  "
                        f"idle 3/16 (18.8%)")
    assert lines[1] == "layers.2.moe: max/mean 1.00  min/mean 1.00  idle 0/8 (0.0%)"
    assert lines[2] == "layers.3.moe: no tokens  idle 4/4 (100.0%)"
