"""Ending a run that stopped making progress, on every rank that still runs, with one line that says where.

Two bounds, both TrainSpec fields (`timeouts`):
    collective_minutes   the process group's timeout: a collective that waits longer fails on the ranks waiting in it
                         (gloo raises; NCCL, with TORCH_NCCL_ASYNC_ERROR_HANDLING=1 set before init, aborts its
                         communicators and ends the process). The trainer turns the raised error into RankFailure.
    watchdog_minutes     a thread that ends the process (exit EXIT_STALLED) when no progress mark -- a completed
                         step, a finished checkpoint save or load, an evaluation -- arrives for this long: also a
                         rank stuck outside collectives (I/O, a deadlock) ends.

Which rank: every rank's watchdog thread beats into the job's TCPStore (the rendezvous store at MASTER_ADDR:
MASTER_PORT) every `interval` seconds: a counter `beat/<rank>` and its last completed step. A rank that is stopped
(SIGSTOP), dead or wedged with the GIL held stops beating; the line names the ranks whose counter did not move over a
few intervals, and the ranks behind in steps. The rank with the lowest number among those still beating prints it;
the others exit quietly with the same status.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

EXIT_STALLED = 3  # a rank failed or the run stalled: fix or replace the node, then --resume (user errors exit 2)
_COMM_ERROR = re.compile(r"gloo|nccl|connection (reset|closed|refused)|timed out|broken pipe|c10d|processgroup|"
                         r"socket|peer", re.IGNORECASE)


class RankFailure(RuntimeError):
    """A peer stopped answering or a collective failed; the message is one line naming the rank(s), the step and
    the last checkpoint. `print_here`: this rank is the one that reports it (the others stay quiet)."""

    def __init__(self, message: str, print_here: bool):
        super().__init__(message)
        self.print_here = print_here


def is_comm_error(err: BaseException) -> bool:
    """A failed or timed-out collective (gloo / NCCL / the store), as opposed to a bug or a user error."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    return isinstance(err, RuntimeError) and bool(_COMM_ERROR.search(str(err)))


class Heartbeat:
    """Per-rank liveness in the job's TCPStore (a client connection of its own, with a short timeout)."""

    def __init__(self, rank: int, world: int, store):
        self.rank, self.world, self.store = rank, world, store
        self.prefix = f"moestack/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"

    @classmethod
    def connect(cls, rank: int, world: int, timeout_s: float = 10.0) -> Heartbeat | None:
        """A client of the store at MASTER_ADDR:MASTER_PORT, or None when there is none to reach (a process group
        made from a file store, a single process)."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world <= 1 or not host or not port or not port.isdigit():
            return None
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                                  wait_for_workers=False)
        except Exception:  # noqa: BLE001 - no store to reach: run without heartbeats (the line says so)
            return None
        return cls(rank, world, store)

    def beat(self, step: int) -> None:
        self.store.add(f"{self.prefix}beat/{self.rank}", 1)
        self.store.set(f"{self.prefix}step/{self.rank}", str(step))

    def _read(self) -> tuple[dict[int, int], dict[int, int]]:
        beats, steps = {}, {}
        for r in range(self.world):
            key = f"{self.prefix}beat/{r}"
            if self.store.check([key]):
                beats[r] = self.store.add(key, 0)
                steps[r] = int(self.store.get(f"{self.prefix}step/{r}"))
        return beats, steps

    def silent_ranks(self, wait_s: float) -> tuple[list[int], dict[int, int]]:
        """(ranks whose beat did not advance within wait_s, last completed step per rank that ever beat)."""
        before, _ = self._read()
        time.sleep(wait_s)
        after, steps = self._read()
        silent = [r for r in range(self.world) if r != self.rank and after.get(r, -1) == before.get(r, -1)]
        return silent, steps


def _ranks(ranks: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


def diagnose(heartbeat: Heartbeat | None, rank: int, interval_s: float, world: int = 2) -> tuple[str, bool]:
    """(what the heartbeats say about the other ranks, whether this rank reports it)."""
    if world <= 1:
        return "one process, stuck in this step (I/O, a deadlock, or a step longer than the bound)", True
    if heartbeat is None:
        return "which rank stalled is unknown (no heartbeat store)", True
    try:
        silent, steps = heartbeat.silent_ranks(wait_s=2.5 * interval_s)
    except Exception as err:  # noqa: BLE001 - the store's host itself is gone
        return (f"the rendezvous store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} does not "
                f"answer either ({type(err).__name__}): rank 0's host or the launcher is gone"), True
    alive = [r for r in range(heartbeat.world) if r not in silent]
    reporter = rank == min(alive)
    if silent:
        many = len(silent) > 1
        return (f"rank{'s' if many else ''} {_ranks(silent)} stopped answering (stopped, hung with the GIL held, "
                f"or dead: no heartbeat for {2.5 * interval_s:.1f} s)"), reporter
    behind = sorted(r for r, s in steps.items() if s < max(steps.values(), default=0))
    if behind:
        return (f"every rank still answers; rank{'s' if len(behind) > 1 else ''} {_ranks(behind)} "
                f"behind at step {min(steps[r] for r in behind)}"), reporter
    return "every rank still answers and is at the same step (a hang inside a collective or I/O)", reporter


class Watchdog:
    """The progress thread: beats every `interval_s`; with bound_s > 0, ends the process when `mark()` has not
    been called for bound_s. `describe()` gives "during step N ...; last checkpoint: ..." for the line."""

    def __init__(self, bound_s: float, rank: int, heartbeat: Heartbeat | None, describe: Callable[[], str],
                 interval_s: float | None = None, world: int = 1):
        self.bound_s, self.rank, self.heartbeat, self.describe = bound_s, rank, heartbeat, describe
        self.world = world
        self.interval_s = interval_s or min(10.0, max(1.0, (bound_s or 100.0) / 10))
        self.step = 0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None and (self.bound_s > 0 or self.heartbeat is not None):
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="moestack-watchdog", daemon=True)
            self._thread.start()

    def mark(self, step: int | None = None) -> None:
        """Progress: call from the training thread after each step, checkpoint save / load and evaluation."""
        if step is not None:
            self.step = step
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.heartbeat is not None:
                try:
                    self.heartbeat.beat(self.step)
                except Exception:  # noqa: BLE001 - the store is gone; the collectives will say so
                    pass
            idle = time.monotonic() - self._last
            if self.bound_s > 0 and idle > self.bound_s:
                self._fire(idle)

    def _fire(self, idle_s: float) -> None:
        others, reporter = diagnose(self.heartbeat, self.rank, self.interval_s, self.world)
        if reporter:
            line = (f"error: no progress for {idle_s / 60:.1f} min (bound {self.bound_s / 60:g} min: "
                    f"timeouts.watchdog_minutes / collective_minutes) {self.describe()}; {others}; ending the run on "
                    "every rank that still runs: fix or replace the node, then resume with --resume")
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        os._exit(EXIT_STALLED)


def rank_failure(err: BaseException, heartbeat: Heartbeat | None, rank: int, interval_s: float,
                 where: str) -> RankFailure:
    """The RankFailure for a communication error `err` raised on this rank `where` ("during step N ...")."""
    others, reporter = diagnose(heartbeat, rank, interval_s)
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0][:160]  # gloo prefixes its source location
    return RankFailure(f"a collective failed on rank {rank} ({first}) {where}; {others}; fix or replace the node, "
                       "then resume with --resume", reporter)
