"""The run directory's single-writer lock and its crash-safe metrics file.

Lock: `out_dir/.run.lock`, an exclusive flock held by the run's rank 0 from its first write into the directory
(resume or fit) until it ends; the kernel drops it when the process dies (kill -9 included), so there is no stale
lock to clean up. The file records the holder (pid, host, start time, command) so that a second writer is refused
with one line naming it. On a filesystem whose flock is node-local, the lock guards one node only.

metrics.jsonl: one JSON object per line, appended with one write() of the whole line on an O_APPEND descriptor
(a kill leaves whole lines, at most a torn last one, never a line spliced into another); on start the file is
rewritten (temp file + rename) to the records at or before the step the run starts from, without a torn tail, so
a killed and resumed run holds each step once.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from moestack.config.base import ConfigError

LOCK_NAME = ".run.lock"


class RunLock:
    """An exclusive lock on a run directory. `acquire()` raises ConfigError (one line naming the holder) when
    another process holds it; `release()` (or process exit) drops it."""

    def __init__(self, out_dir: str | Path):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(f"out_dir: cannot write into '{self.out_dir}' ({err.strerror}); pick a writable "
                              "--out") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(f"out_dir: '{self.out_dir}' is in use by another run ({holder}); wait for it to end, "
                              "or train into another --out") from None
        except OSError:
            pass  # no flock on this filesystem (ENOLCK, EOPNOTSUPP): run unlocked
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "argv": " ".join(sys.argv)[:200]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (ValueError, KeyError, TypeError, OSError):
        return "holder unknown"


# ---------------------------------------------------------------------------------------------- metrics.jsonl


def read_jsonl(path: str | Path) -> tuple[list[dict], int]:
    """(records, number of lines dropped): lines that are not a JSON object (a torn last line, garbage) are
    dropped."""
    records, dropped = [], 0
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            dropped += 1
    return records, dropped


def rewind_jsonl(path: str | Path, step: int) -> tuple[int, int]:
    """Rewrite `path` atomically to its records with record["step"] <= step (and no unreadable lines). Returns
    (records dropped for a later step, unreadable lines dropped); (0, 0) leaves the file untouched."""
    path = Path(path)
    records, torn = read_jsonl(path)
    keep = [r for r in records if isinstance(r.get("step"), int) and r["step"] <= step]
    later = len(records) - len(keep)
    if not later and not torn:
        return 0, 0
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return later, torn


class LineAppender:
    """Append whole lines to a file: one write() per line on an O_APPEND descriptor (complete lines or nothing,
    whatever else appends). `sync()` makes them durable (fsync), e.g. next to a checkpoint."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, line: str) -> None:
        assert self._fd is not None, "appender closed"
        data = (line.rstrip("\n") + "\n").encode()
        while data:  # a regular file takes it in one write(); loop only for an interrupted partial one
            data = data[os.write(self._fd, data):]

    def sync(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
