"""One writer per run directory, a leftover sweep that spares live saves, metrics.jsonl that survives a crash, and
resume that falls back past broken checkpoints with a line each (never a silent start from step 0)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from moestack.cli.app import main
from moestack.config import load_model_spec, load_train_spec
from moestack.config.base import ConfigError
from moestack.train.checkpoint import WRITER_LOCK, CheckpointError, find_resumable, save_checkpoint
from moestack.train.metrics import MetricsLogger, read_metrics
from moestack.train.run_dir import LOCK_NAME, LineAppender, RunLock, read_jsonl, rewind_jsonl
from moestack.train.trainer import Trainer

_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
if len(sys.argv) > 2:
    os.write(fd, ('{"pid": %d, "host": "elsewhere", "since": "then"}' % os.getpid()).encode())
print("held", flush=True)
time.sleep(60)
"""


def _hold_in_other_process(path: Path, holder_info: bool = False) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path), *(["x"] if holder_info else [])],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def test_second_writer_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = _hold_in_other_process(out / LOCK_NAME, holder_info=True)
    try:
        with pytest.raises(ConfigError, match=rf"in use by another run \(pid {holder.pid} on elsewhere") as err:
            RunLock(out).acquire()
        assert "\n" not in str(err.value) and "another --out" in str(err.value)
    finally:
        _end(holder)
    lock = RunLock(out)  # the holder died (kill -9): the kernel dropped its lock, nothing stale is left
    lock.acquire()
    info = json.loads((out / LOCK_NAME).read_text())
    assert info["pid"] == os.getpid()
    lock.release()


def test_two_trainers_on_one_folder_cannot_both_write(tmp_path):
    spec = load_train_spec(None, {"out_dir": str(tmp_path / "run"), "steps": 1, "micro_batch_size": 2,
                                  "seq_len": 16, "logging.tensorboard": False, "logging.progress": False,
                                  "eval_every": 0, "data.eval_fraction": 0.0})
    first = Trainer(spec, load_model_spec("tiny"), log=lambda *a: None)
    second = Trainer(spec, load_model_spec("tiny"), log=lambda *a: None)
    assert not first.resume()  # claims the folder (nothing to resume)
    with pytest.raises(ConfigError, match=rf"in use by another run \(pid {os.getpid()}"):
        second.fit()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # the refused one wrote nothing
    first.fit()
    first.close()
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1]


class _Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)


def test_leftover_sweep_spares_a_live_save(tmp_path):
    root = tmp_path / "ckpt"
    live, stale = root / ".tmp_step_00000007", root / ".tmp_step_00000005"
    for d in (live, stale):
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"half written")
    (stale / WRITER_LOCK).touch()  # its writer died: nobody holds it
    writer = _hold_in_other_process(live / WRITER_LOCK)  # another process is writing step 7 right now
    try:
        model = _Lin()
        save_checkpoint(root, 6, model, None, {"step": 6}, keep=2)
        assert live.is_dir() and (live / "__0_0.distcp").read_bytes() == b"half written"
        assert not stale.exists()
        assert (root / "step_00000006").is_dir()
    finally:
        _end(writer)
    save_checkpoint(root, 8, _Lin(), None, {"step": 8}, keep=2)
    assert not live.exists()  # its writer is gone now: a leftover


def test_rewind_drops_later_steps_and_torn_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "train/loss": 1.0 / s}) for s in range(1, 8)]
    path.write_text("\n".join(lines[:5]) + '\n{"step": 6, "train/lo' + "\n" + "\n".join(lines[5:]) + "\n[1, 2]\n")
    assert read_jsonl(path)[1] == 2
    inode = path.stat().st_ino
    assert rewind_jsonl(path, 4) == (3, 2)  # steps 5..7 and the torn / non-object lines
    assert [r["step"] for r in read_jsonl(path)[0]] == [1, 2, 3, 4]
    assert path.stat().st_ino != inode  # replaced by rename, not rewritten in place
    assert rewind_jsonl(path, 4) == (0, 0) and path.stat().st_ino == path.stat().st_ino


def test_torn_line_does_not_swallow_the_next_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "train/loss": 2.0}) + "\n" + '{"step": 2, "train/lo')  # killed mid-line
    log = MetricsLogger(tmp_path, tensorboard=False, start_step=1)  # the resumed run starts from step 1
    assert log.dropped == (0, 1)
    log.log(2, {"loss": 1.5})
    log.close()
    assert [(r["step"], r["train/loss"]) for r in read_metrics(path)] == [(1, 2.0), (2, 1.5)]


def test_line_appender_writes_whole_lines(tmp_path):
    path = tmp_path / "x.jsonl"
    a, b = LineAppender(path), LineAppender(path)  # two descriptors appending to one file
    for i in range(50):
        (a if i % 2 else b).write(json.dumps({"step": i, "pad": "x" * (i * 37)}))
    a.close()
    b.close()
    assert [r["step"] for r in read_jsonl(path)[0]] == list(range(50)) and read_jsonl(path)[1] == 0


FAST = ["-q", "--batch-size", "2", "--seq-len", "16", "--set", "logging.tensorboard=false", "--set", "eval_every=0",
        "--set", "data.eval_fraction=0", "--set", "logging.every=1"]


@pytest.fixture(scope="module")
def _run_with_two_checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("run_dir") / "run"
    assert main(["train", "--steps", "4", "--out", str(out), "--set", "checkpoint.every=2", *FAST]) == 0
    return out


@pytest.fixture
def run(_run_with_two_checkpoints, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(_run_with_two_checkpoints, out)
    return out


def _corrupt(ckpt: Path) -> None:
    victim = max((p for p in ckpt.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


@pytest.mark.slow
def test_resume_falls_back_to_the_newest_intact_checkpoint(run, capsys):
    ckpts = run / "checkpoints"
    _corrupt(ckpts / "step_00000004")
    capsys.readouterr()
    assert main(["train", "--steps", "5", "--out", str(run), "--resume", *FAST]) == 0
    text = capsys.readouterr().out
    assert "skipped step_00000004: checksum mismatch" in text and "resuming from step_00000002" in text
    assert "resumed from" in text and "at step 2" in text
    train = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "train/loss" in r]
    assert train == [1, 2, 3, 4, 5]  # steps 3 and 4 of the first run were dropped, then replayed once


@pytest.mark.slow
def test_incomplete_checkpoint_is_named_never_skipped_silently(run, capsys):
    ckpts = run / "checkpoints"
    (ckpts / "step_00000004" / "COMPLETE").unlink()
    path, notes = find_resumable(ckpts)
    assert path == ckpts / "step_00000002"
    assert notes == ["skipped step_00000004: no COMPLETE marker (the save did not finish); resuming from "
                     "step_00000002, the newest intact checkpoint"]
    (ckpts / "step_00000002" / "COMPLETE").unlink()
    capsys.readouterr()
    assert main(["train", "--steps", "5", "--out", str(run), "--resume", *FAST]) == 2  # not "starting from step 0"
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --resume: no intact checkpoint") and "\n" not in err
    assert "step_00000004" in err and "step_00000002" in err


@pytest.mark.slow
def test_new_run_into_a_folder_with_checkpoints_is_refused(run, capsys):
    before = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", "--steps", "5", "--out", str(run), *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds checkpoints of an earlier run (newest step_00000004)" in err and "--resume" in err
    assert (run / "metrics.jsonl").read_text() == before


def test_interrupted_save_alone_is_named(tmp_path):
    root = tmp_path / "ckpt"
    (root / ".tmp_step_00000003").mkdir(parents=True)
    assert find_resumable(root) == (None, ["ignored .tmp_step_00000003 (an interrupted save: never completed, not a "
                                           "checkpoint)"])
    assert find_resumable(tmp_path / "absent") == (None, [])
    (root / "step_00000002").mkdir()
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        find_resumable(root)

