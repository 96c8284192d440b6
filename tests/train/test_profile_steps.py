"""`moestack train --profile-steps A:B`: the profiled window writes per-rank tables and a trace; bad windows are
one-line errors naming the option."""

from __future__ import annotations

import gzip
import json

import pytest

from moestack.cli.app import main
from moestack.config import load_train_spec
from moestack.config.base import ConfigError

ARGS = ["train", "--steps", "4", "-q", "--batch-size", "2", "--seq-len", "16", "--device", "cpu",
        "--set", "logging.tensorboard=false", "--set", "logging.every=1", "--set", "eval_every=0",
        "--set", "checkpoint.every=0", "--set", "checkpoint.save_final=false"]


def test_profile_steps_writes_tables_and_trace(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*ARGS, "--out", str(out), "--profile-steps", "2:4"]) == 0
    text = (out / "profile_rank0.txt").read_text()
    header = text.splitlines()[0]
    assert "2 profiled steps" in header and "steps 2..3" in header and "mean wall" in header, header
    assert "aten::mm" in text and "self_cpu_time_total" in text
    with gzip.open(out / "profile_rank0.json.gz", "rt") as f:
        assert json.load(f)["traceEvents"]
    # the profiler only observes: the same losses and gradient norms as a run without it, every step logged
    assert main([*ARGS, "--out", str(tmp_path / "plain")]) == 0
    assert _logged(out) == _logged(tmp_path / "plain") and len(_logged(out)) == 4


def _logged(run) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in rows if "train/loss" in r]


@pytest.mark.parametrize("window", ["4:2", "5", "a:b", "0:2", "2:9"])
def test_bad_profile_steps_is_a_one_line_error(tmp_path, capsys, window):
    assert main([*ARGS, "--out", str(tmp_path / "run"), "--profile-steps", window]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "--profile-steps" in err and "\n" not in err, err
    assert not (tmp_path / "run").exists()


def test_profile_steps_in_yaml_must_be_quoted():
    assert load_train_spec(None, {"profile_steps": "6:9", "steps": 10}).profile_window == (6, 9)
    with pytest.raises(ConfigError, match="quote it"):
        load_train_spec(None, {"profile_steps": 369, "steps": 10})  # what YAML makes of an unquoted 6:9
