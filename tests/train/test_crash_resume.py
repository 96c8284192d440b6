"""kill -9 during checkpoint writes, again and again, then resume: the final weights and every step's loss are
bit-identical to the uninterrupted run, and metrics.jsonl holds each step once (what loss.png plots)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moestack.train.convert import CheckpointSource
from moestack.train.metrics import read_metrics

_REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY, KILLS = 10, 2, 3
ARGS = ["-q", "--steps", str(STEPS), "--batch-size", "2", "--seq-len", "16", "--set", "logging.every=1",
        "--set", "logging.tensorboard=false", "--set", "eval_every=0", "--set", "data.eval_fraction=0",
        "--set", f"checkpoint.every={EVERY}", "--set", "checkpoint.keep=2"]


def _train(out: Path, resume: bool) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO)}
    cmd = [sys.executable, "-m", "moestack", "train", "--out", str(out), *ARGS, *(["--resume"] if resume else [])]
    return subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_during_a_save(proc: subprocess.Popen, ckpts: Path, rng: random.Random, timeout: float = 180) -> bool:
    """SIGKILL `proc` while a `.tmp_step_*` directory exists (a save in progress), after 0-20 ms more; False if the
    run finished first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            saving = any(name.startswith(".tmp_step_") for name in os.listdir(ckpts))
        except FileNotFoundError:
            saving = False
        if saving:
            time.sleep(rng.uniform(0, 0.02))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.001)
    proc.kill()
    raise AssertionError("no checkpoint save seen in time")


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in read_metrics(run / "metrics.jsonl") if "train/loss" in r]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_during_saves_and_resumed_is_bit_exact(tmp_path):
    rng = random.Random(0)
    ref_proc = _train(tmp_path / "ref", resume=False)  # the uninterrupted run, alongside
    run = tmp_path / "crashed"
    kills = 0
    for _ in range(KILLS):
        if not _kill_during_a_save(_train(run, resume=True), run / "checkpoints", rng):
            break
        kills += 1
    final = _train(run, resume=True)
    out, err = final.communicate(timeout=300)
    assert final.returncode == 0, err[-3000:]
    ref_out, ref_err = ref_proc.communicate(timeout=300)
    assert ref_proc.returncode == 0, ref_err[-3000:]
    assert kills == KILLS, "every attempt was killed inside a save"

    got, want = _losses(run), _losses(tmp_path / "ref")
    assert [s for s, _ in got] == list(range(1, STEPS + 1))  # each step once, in order
    assert got == want  # bit-identical losses (JSON keeps every float's digits)
    last = f"step_{STEPS:08d}"
    a, b = CheckpointSource(run / "checkpoints" / last), CheckpointSource(tmp_path / "ref" / "checkpoints" / last)
    names = sorted(a.keys())
    assert names == sorted(b.keys())
    ta, tb = a.get(names), b.get(names)
    assert all(torch.equal(ta[n], tb[n]) for n in names)
    assert not any(p.name.startswith(".tmp_") for p in (run / "checkpoints").iterdir())
