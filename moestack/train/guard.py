"""What a trainer holds while it writes into its run directory: the run lock (rank 0, moestack/train/run_dir.py),
the progress watchdog and the heartbeat (every rank, moestack/train/watchdog.py). One object, so that the training
loop has three calls: `claim()` before the first write, `mark(step)` on progress, `release()` at the end.

The watchdog's bound: timeouts.watchdog_minutes; on CUDA with several ranks also at most
timeouts.collective_minutes. A stalled NCCL collective does not raise in Python (the host waits in a CUDA sync),
so the watchdog is what reports it, naming the rank; NCCL's own timeout is set later as the backstop
(trainer._init_distributed). Gloo raises in the collective itself: RankFailure."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from moestack.config.base import ConfigError
from moestack.config.train_spec import TimeoutSpec
from moestack.train.run_dir import RunLock
from moestack.train.watchdog import Heartbeat, RankFailure, Watchdog, is_comm_error, rank_failure


def watchdog_bounds(timeouts: TimeoutSpec, device_type: str, world: int) -> tuple[float, float]:
    """(seconds without progress that end the run (0: never), seconds between heartbeats) -- see the module
    docstring; beats come often enough (>= 10 per bound, 1..10 s) to tell a silent rank within the tighter bound."""
    collective_s, watchdog_s = timeouts.collective_minutes * 60, timeouts.watchdog_minutes * 60
    bound = watchdog_s
    if device_type == "cuda" and world > 1:
        bound = min(watchdog_s, collective_s) if watchdog_s > 0 else collective_s
    interval = min(10.0, max(1.0, min(b for b in (bound, collective_s) if b > 0) / 10))
    return bound, interval


class RunGuard:
    def __init__(self, out_dir: Path, timeouts: TimeoutSpec, rank: int, world: int, device: torch.device,
                 describe: Callable[[], str]):
        self.lock = RunLock(out_dir)
        self.timeouts, self.rank, self.world, self.device, self.describe = timeouts, rank, world, device, describe
        self.watchdog: Watchdog | None = None
        self.failed = False  # a peer failed: the process group is not destroyed (it could wait on the dead peer)

    def claim(self) -> None:
        """Take the run lock on rank 0 (every rank learns whether it got it: collective when world > 1) and start
        the watchdog. Raises ConfigError naming the holder when another run writes into the directory."""
        if self.watchdog is not None:
            return
        problem = None
        if self.rank == 0:
            try:
                self.lock.acquire()
            except ConfigError as err:
                problem = err
        if self.world > 1:
            flag = torch.tensor([0.0 if problem is None else 1.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and problem is None:
                problem = ConfigError(f"out_dir: '{self.lock.out_dir}' is in use by another run (rank 0 names it)")
        if problem is not None:
            raise problem
        heartbeat = Heartbeat.connect(self.rank, self.world) if self.world > 1 else None
        bound, interval = watchdog_bounds(self.timeouts, self.device.type, self.world)
        self.watchdog = Watchdog(bound, self.rank, heartbeat, self.describe, interval, self.world)
        self.watchdog.start()

    def mark(self, step: int | None = None) -> None:
        if self.watchdog is not None:
            self.watchdog.mark(step)

    def failure(self, err: BaseException) -> RankFailure | None:
        """The one-line RankFailure for a communication error of a multi-rank run, else None (re-raise err)."""
        if self.world <= 1 or not is_comm_error(err):
            return None
        self.failed = True
        hb = self.watchdog.heartbeat if self.watchdog is not None else None
        interval = self.watchdog.interval_s if self.watchdog is not None else 1.0
        return rank_failure(err, hb, self.rank, interval, self.describe())

    def release(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        self.lock.release()
