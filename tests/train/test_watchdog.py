"""A stalled or dead rank ends the run within the configured bound, with one line naming the rank, the step and the
last checkpoint: 2 gloo ranks of `moestack train --plan` (pure data parallel), launched as two processes with
torchrun's environment; rank 1 is SIGSTOPped (or killed) once rank 0 has logged a few steps.

    stop + collective timeout   rank 0's collective times out (timeouts.collective_minutes): RankFailure, exit 3
    stop + watchdog             the collective would wait a minute; the watchdog (timeouts.watchdog_minutes) ends it
    kill -9                     rank 0's collective fails at once (connection reset): the same line, exit 3
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moestack.config.plan import make_plan, save_plan
from moestack.config.train_spec import TimeoutSpec
from moestack.train.guard import watchdog_bounds
from moestack.train.watchdog import EXIT_STALLED, Heartbeat, RankFailure, Watchdog, is_comm_error

_REPO = Path(__file__).resolve().parents[2]
STEPS_BEFORE_FAULT = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(tmp: Path, collective_min: float, watchdog_min: float,
            device: str = "cpu") -> tuple[list[subprocess.Popen], Path]:
    plan = tmp / "plan.yaml"
    save_plan(make_plan(model="tiny", cluster="cpu", devices=2, seq_len=16, global_batch_size=4, micro_batch_size=2,
                        dp_replicate=2), plan)
    out = tmp / "run"
    port = str(_free_port())
    args = [sys.executable, "-m", "moestack", "train", "--plan", str(plan), "--out", str(out), "--steps", "100000",
            "--device", device,
            "-q", "--set", "logging.every=1", "--set", "logging.tensorboard=false", "--set", "eval_every=0",
            "--set", "checkpoint.every=2", "--set", "checkpoint.keep=1", "--set", "checkpoint.save_final=false",
            "--set", f"timeouts.collective_minutes={collective_min}",
            "--set", f"timeouts.watchdog_minutes={watchdog_min}"]
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port}
        procs.append(subprocess.Popen(args, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs, out


def _wait_for_steps(procs, out: Path, steps: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a rank ended before the fault: " + procs[0].stderr.read()[-3000:])
        if metrics.is_file():
            done = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            if sum("train/loss" in r for r in done) >= steps and (out / "checkpoints").is_dir() and any(
                    p.name.startswith("step_") for p in (out / "checkpoints").iterdir()):
                return
        time.sleep(0.2)
    raise AssertionError("the run did not reach the fault point in time")


def _fault_and_wait(procs, fault: int, bound_s: float) -> tuple[int, str, float]:
    """Send `fault` to rank 1; (rank 0's exit code, its stderr, seconds it took to end)."""
    t0 = time.monotonic()
    os.kill(procs[1].pid, fault)
    try:
        rc = procs[0].wait(timeout=bound_s + 30)
    finally:
        for p in procs:  # the stopped rank cannot end itself: the launcher would kill it, here the test does
            if p.poll() is None:
                p.kill()
            p.wait()
    return rc, procs[0].stderr.read(), time.monotonic() - t0


def _check_line(err: str, out: Path) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err[-3000:]
    line = lines[0]
    assert "rank 1 stopped answering" in line, line
    assert "during step" in line and str(out / "checkpoints" / "step_") in line, line
    assert "--resume" in line
    return line


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", ["collective", "watchdog"])
def test_stopped_rank_ends_the_run_within_the_bound(tmp_path, path):
    # collective: gloo gives up after 6 s; watchdog: no step for 6 s ends it while the collective would wait 60 s
    collective_min, watchdog_min = (0.1, 1.0) if path == "collective" else (1.0, 0.1)
    procs, out = _launch(tmp_path, collective_min, watchdog_min)
    _wait_for_steps(procs, out, STEPS_BEFORE_FAULT)
    bound = 6.0
    rc, err, took = _fault_and_wait(procs, signal.SIGSTOP, bound)
    assert rc == EXIT_STALLED, err[-3000:]
    line = _check_line(err, out)
    # the bound, the heartbeat check (2.5 beats of 1 s) and the exit; far from gloo's 30 minutes
    assert took < bound + 10, took
    assert ("a collective failed on rank 0" in line) == (path == "collective"), line
    assert ("timeouts.watchdog_minutes" in line) == (path == "watchdog"), line


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dead_rank_ends_the_run_with_one_line(tmp_path):
    procs, out = _launch(tmp_path, 1.0, 1.0)
    _wait_for_steps(procs, out, STEPS_BEFORE_FAULT)
    rc, err, took = _fault_and_wait(procs, signal.SIGKILL, 10)
    assert rc == EXIT_STALLED, err[-3000:]
    _check_line(err, out)
    assert took < 20, took  # the peer's socket closes at once; then 2.5 s of heartbeat check


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_stopped_rank_ends_an_nccl_run_with_one_line(tmp_path):
    """NCCL (2 GPUs): a stalled collective does not raise in Python; the watchdog, bounded by
    timeouts.collective_minutes on CUDA, reports it before NCCL's own (later) teardown."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    procs, out = _launch(tmp_path, 0.1, 1.0, device="cuda")
    _wait_for_steps(procs, out, STEPS_BEFORE_FAULT)
    rc, err, took = _fault_and_wait(procs, signal.SIGSTOP, 6.0)
    assert rc == EXIT_STALLED, err[-3000:]
    line = _check_line(err, out)
    assert "no progress for" in line and took < 16, (line, took)


def test_comm_errors_are_told_apart_from_bugs():
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                        "6000ms for recv operation to complete")
    assert is_comm_error(gloo)
    assert is_comm_error(RuntimeError("[../pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer"))
    assert not is_comm_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))
    assert not is_comm_error(ValueError("Timed out"))  # only RuntimeErrors come from the backends
    assert RankFailure("x", print_here=False).print_here is False


class _FakeStore:
    """In-memory stand-in for the TCPStore (add / set / get / check), shared by every rank's Heartbeat."""

    def __init__(self):
        self.data: dict[str, int | str] = {}

    def add(self, key, n):
        self.data[key] = int(self.data.get(key, 0)) + n
        return self.data[key]

    def set(self, key, value):
        self.data[key] = value

    def get(self, key):
        return str(self.data[key]).encode()

    def check(self, keys):
        return all(k in self.data for k in keys)


def test_heartbeat_names_the_silent_rank(monkeypatch):
    import moestack.train.watchdog as wd

    store = _FakeStore()
    beats = [Heartbeat(r, 3, store) for r in range(3)]
    for hb in beats:
        hb.beat(7)
    beats[2].beat(8)

    def sleep_while_others_beat(_):  # ranks 0 and 2 beat during the wait, rank 1 is silent
        beats[0].beat(7)
        beats[2].beat(8)

    monkeypatch.setattr(wd.time, "sleep", sleep_while_others_beat)
    silent, steps = beats[0].silent_ranks(wait_s=1.0)
    assert silent == [1] and steps == {0: 7, 1: 7, 2: 8}
    what, reporter = wd.diagnose(beats[2], 2, interval_s=1.0)
    assert "rank 1 stopped answering" in what and not reporter  # rank 0 still beats: it reports
    what, reporter = wd.diagnose(beats[0], 0, interval_s=1.0)
    assert reporter


def test_watchdog_ends_a_stuck_single_process(monkeypatch, capsys):
    """No mark() within the bound: one line naming the step and the last checkpoint, then exit EXIT_STALLED (here
    os._exit is replaced so the test process survives); marks in time keep it quiet."""
    exits, fired = [], threading.Event()

    def fake_exit(code):
        exits.append(code)
        fired.set()

    monkeypatch.setattr(os, "_exit", fake_exit)
    dog = Watchdog(0.4, 0, None, lambda: "during step 4 (3 completed); last checkpoint: ck/step_00000002",
                   interval_s=0.05)
    dog.start()
    for step in range(1, 6):  # progress every 0.1 s: no alarm
        time.sleep(0.1)
        dog.mark(step)
    assert not fired.is_set()
    assert fired.wait(5)
    dog.stop()
    assert exits[0] == EXIT_STALLED
    err = capsys.readouterr().err.strip().splitlines()[0]
    assert err.startswith("error: no progress for") and "during step 4" in err and "step_00000002" in err
    assert "one process" in err


def test_watchdog_bounds():
    t = TimeoutSpec(collective_minutes=10, watchdog_minutes=15)
    assert watchdog_bounds(t, "cpu", 8) == (900.0, 10.0)  # gloo raises at 10 min itself
    assert watchdog_bounds(t, "cuda", 8) == (600.0, 10.0)  # NCCL does not: the watchdog reports at 10 min
    assert watchdog_bounds(t, "cuda", 1) == (900.0, 10.0)
    assert watchdog_bounds(TimeoutSpec(collective_minutes=0.1, watchdog_minutes=0), "cuda", 2) == (6.0, 1.0)
    assert watchdog_bounds(TimeoutSpec(collective_minutes=0.1, watchdog_minutes=0), "cpu", 2) == (0.0, 1.0)
