"""Expert-load telemetry: the statistics against hand values, the records / progress column / collapse warning of
the monitor, the heatmap, and a short training run writing them (metrics.jsonl, expert_load.png)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moestack.train.expert_load import STATS, ExpertLoadMonitor, even_rank_load, load_stats


def test_load_stats_hand_values():
    counts = torch.tensor([[4, 0, 2, 2], [2, 2, 2, 2], [0, 0, 0, 0]])
    ranks = torch.stack([even_rank_load(c, 2) for c in counts])
    s = load_stats(counts, ranks)
    assert s.shape == (3, len(STATS))
    mx, mn, idle, cv, rank = s[0].tolist()
    assert (mx, mn, idle) == (2.0, 0.0, 1.0)
    assert cv == pytest.approx(math.sqrt(((4 - 2) ** 2 + 4 + 0 + 0) / 4) / 2)
    assert rank == pytest.approx(4 / 4)  # ranks hold 4 and 4 tokens
    assert s[1].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert all(math.isnan(v) for i, v in enumerate(s[2].tolist()) if i != 2)  # no tokens: ratios undefined
    assert torch.isnan(load_stats(counts)[:, 4]).all()  # no EP: no rank statistic


def test_monitor_records_column_and_collapse_warning(tmp_path):
    warnings = []
    mon = ExpertLoadMonitor(["1", "3"], 8, collapse_idle_fraction=0.25, collapse_window=3, ep=2, warn=warnings.append)
    balanced = torch.full((8,), 5)
    collapsed = torch.tensor([20, 20, 0, 0, 0, 0, 0, 0])
    for step in range(1, 6):
        rec = mon.observe(step * 10, {"1": balanced, "3": collapsed})
        assert rec["load/1/max_mean"] == 1.0 and rec["load/3/max_mean"] == 4.0 and rec["load/3/idle"] == 6.0
        assert rec["load/worst_max_mean"] == 4.0 and rec["load/idle_experts"] == 6.0
        assert rec["load/3/rank_max_mean"] == 2.0 and rec["load/worst_rank_max_mean"] == 2.0
    assert mon.column == "load 4.00 (L3) idle 6 rank 2.00"
    assert len(warnings) == 1 and "MoE layer 3 collapsed" in warnings[0] and "step 30" in warnings[0]
    mon.observe(60, {"1": balanced, "3": balanced})  # the streak breaks; a new one warns again
    for step in range(7, 10):
        mon.observe(step * 10, {"1": balanced, "3": collapsed})
    assert len(warnings) == 2
    png = mon.heatmap(tmp_path / "expert_load.png")
    assert png.is_file() and png.stat().st_size > 1000
    assert ExpertLoadMonitor(["1"], 4, 0.25, 10).heatmap(tmp_path / "none.png") is None


def test_training_run_writes_load_records_and_heatmap(tmp_path):
    from moestack.config.model_spec import load_model_spec
    from moestack.config.train_spec import load_train_spec
    from moestack.train.trainer import Trainer

    spec = load_train_spec(None, {"steps": 3, "out_dir": str(tmp_path), "device": "cpu", "seq_len": 32,
                                  "micro_batch_size": 2, "logging.every": 2, "logging.tensorboard": False,
                                  "logging.progress": False, "checkpoint.save_final": False, "eval_every": 0,
                                  "data.eval_fraction": 0.0})
    trainer = Trainer(spec, load_model_spec("tiny"), log=lambda *a, **k: None)
    seen = []
    result = trainer.fit(lambda step, s: seen.append(s.load))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in rows if "train/loss" in r}
    assert sorted(logged) == [2, 3]
    layers = sorted(trainer.model.moe_layers())
    for r in logged.values():
        for layer in layers:
            for stat in ("max_mean", "min_mean", "idle", "cv"):
                assert f"train/load/{layer}/{stat}" in r
            assert f"train/load/{layer}/rank_max_mean" not in r  # no EP
        assert r["train/load/worst_max_mean"] >= 1.0
    assert seen[0] == "" and seen[1].startswith("load ") and seen[2].startswith("load ")
    assert result["load_heatmap"] == tmp_path / "expert_load.png" and result["load_heatmap"].is_file()


def test_monitor_warns_once_when_the_load_stays_above_the_plan_forecast():
    lines: list[str] = []
    mon = ExpertLoadMonitor(["1"], 4, 0.9, 3, ep=2, warn=lines.append, forecast=1.1)
    skewed = {"1": torch.tensor([30, 30, 10, 10])}  # ranks 60 / 20: busiest rank 1.5x the mean
    even = {"1": torch.tensor([10, 10, 10, 10])}
    for step, counts in enumerate([skewed, skewed, even, skewed, skewed], 1):  # a streak of 2, broken, then 2
        mon.observe(step, counts)
    assert lines == []
    for step in range(6, 10):
        mon.observe(step, skewed)
    assert len(lines) == 1 and "plan.moe_load_imbalance 1.1" in lines[0] and "1.50" in lines[0]
    assert "at step 6" in lines[0]
    lines.clear()
    quiet = ExpertLoadMonitor(["1"], 4, 0.9, 2, warn=lines.append, forecast=None)  # no plan: nothing to compare
    for step in range(1, 5):
        quiet.observe(step, skewed)
    assert lines == []
