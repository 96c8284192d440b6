"""`moestack train --profile-steps A:B`: torch.profiler around the 1-based steps A..B-1 of the training loop.

Steps before A are warm-up (allocator, autotuning, NCCL communicators). The profiler starts before step A and
stops after step B-1 (start()/stop(), no schedule); every rank then writes into the run folder:

  profile_rank{r}.txt      a header (profiled steps, mean wall time per step, device kernel time per step) and two
                           key_averages tables: by self device time (CUDA runs) and by self CPU time (host overhead)
                           and a third table of the collectives grouped by input shape (calls, elements per call,
                           device time per call: the bus bandwidth each call size got)
  profile_rank{r}.json.gz  the chrome trace (chrome://tracing, ui.perfetto.dev); skipped with one line on failure

Each profiled step is one `moestack_step` range: its self CPU time is the host time spent outside any recorded op
(Python, hooks, DTensor dispatch before it reaches aten). The profiler only observes: numerics are unchanged; the
timings logged for the profiled steps (tokens_per_s, mfu) include the profiler's own overhead.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
import time
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function


class StepProfiler:
    def __init__(self, window: tuple[int, int], out_dir: Path, device: torch.device, rank: int):
        self.first, self.last = window  # steps first..last-1
        self.out_dir, self.rank = Path(out_dir), rank
        self.cuda = device.type == "cuda"
        self.prof: profile | None = None
        self.done = False
        self.seconds: list[float] = []  # wall time of each train_step call while profiling (skipped steps too)
        self.steps: list[int] = []  # the step numbers completed while profiling

    @classmethod
    def maybe(cls, window, out_dir, device, rank) -> StepProfiler | None:
        return cls(window, out_dir, device, rank) if window is not None else None

    def step(self, number: int):
        """Context around the train_step call that would complete step `number` (1-based)."""
        if self.done or not self.first <= number < self.last:
            return nullcontext()
        if self.prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = profile(activities=activities, record_shapes=True, with_stack=False)
            self.prof.start()
        return self._timed()

    @contextmanager
    def _timed(self):
        with record_function("moestack_step"):
            t0 = time.perf_counter()
            try:
                yield
            finally:
                if self.cuda:
                    torch.cuda.synchronize()
                self.seconds.append(time.perf_counter() - t0)

    def after(self, completed: int | None) -> None:
        """Call after each train_step with the step it completed (None: skipped as non-finite); stops and writes
        once step last-1 is done."""
        if self.prof is None or self.done:
            return
        if completed is not None:
            self.steps.append(completed)
            if completed >= self.last - 1:
                self.finish()

    def finish(self) -> None:
        """Stop (if running) and write the files; a run that ends inside the window writes what it has."""
        if self.prof is None or self.done:
            return
        self.done = True
        self.prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._write_tables()
        self._write_trace()

    def abort(self) -> None:
        """Stop without writing (the run raised)."""
        if self.prof is not None and not self.done:
            self.done = True
            with suppress(Exception):  # the run's own exception is the one to report
                self.prof.stop()

    def _write_tables(self) -> None:
        events = self.prof.key_averages()
        calls = max(1, len(self.seconds))
        span = f"steps {self.steps[0]}..{self.steps[-1]}" if self.steps else "no step completed"
        header = (f"# moestack train --profile-steps {self.first}:{self.last} rank {self.rank}: {len(self.steps)} "
                  f"profiled steps ({span}; {len(self.seconds)} train_step calls), mean wall "
                  f"{sum(self.seconds) / calls:.4f} s/step")
        kernel_us = self._device_kernel_us()
        if kernel_us is not None:
            header += f", device kernel time {kernel_us / 1e6 / calls:.4f} s/step (sum of self device time of kernels)"
        first_key = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        parts = [header, "", f"## sorted by {first_key}", events.table(sort_by=first_key, row_limit=40)]
        if self.cuda:
            parts += ["", "## sorted by self_cpu_time_total",
                      events.table(sort_by="self_cpu_time_total", row_limit=40)]
        else:  # the same table as above on CPU; written once more only so both sections always exist
            parts += ["", "## sorted by self_cpu_time_total (same as above: no device activity)"]
        parts += ["", "## collectives by input shape", self._collective_table()]
        (self.out_dir / f"profile_rank{self.rank}.txt").write_text("\n".join(parts) + "\n")

    def _collective_table(self) -> str:
        """One row per (collective, input shapes): calls, elements of the first input per call, device / CPU ms per
        call. The sizes let a bandwidth be read off each call size (the planner's tier-0 prices, tune/comm.py)."""
        try:
            groups = self.prof.key_averages(group_by_input_shape=True)
        except Exception as err:  # noqa: BLE001 - optional section
            return f"(not available: {type(err).__name__})"
        rows = ["| op | input shapes | calls | first input, M elements per call | "
                "device ms/call | cpu ms/call |", "|---|---|---|---|---|---|"]
        words = ("nccl", "c10d", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "allreduce", "send",
                 "recv")
        for ev in sorted(groups, key=lambda e: -(getattr(e, "self_device_time_total", 0) or 0)):
            if not any(w in ev.key.lower() for w in words) or not ev.count:
                continue
            shapes = ev.input_shapes or []
            numel = 1
            for d in (shapes[0] if shapes and shapes[0] else [0]):
                numel *= int(d)
            dev = (getattr(ev, "self_device_time_total", 0) or 0) / 1e3 / ev.count
            cpu = ev.cpu_time_total / 1e3 / ev.count
            rows.append(f"| {ev.key} | {str(shapes)[:120]} | {ev.count} | {numel / 2**20:.3f} | {dev:.3f} | "
                        f"{cpu:.3f} |")
        return "\n".join(rows)

    def _device_kernel_us(self) -> float | None:
        if not self.cuda:
            return None
        try:
            kernels = [e for e in self.prof.events() if e.device_type == DeviceType.CUDA]
            if not kernels:
                return None
            return float(sum(getattr(e, "self_device_time_total", 0) or 0 for e in kernels))
        except Exception:  # noqa: BLE001 - an optional number: leave it out
            return None

    def _write_trace(self) -> None:
        dest = self.out_dir / f"profile_rank{self.rank}.json.gz"
        fd, tmp = tempfile.mkstemp(suffix=".json", prefix=f"profile_rank{self.rank}_", dir=self.out_dir)
        os.close(fd)
        try:
            self.prof.export_chrome_trace(tmp)
            with open(tmp, "rb") as src, gzip.open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
        except Exception as err:  # noqa: BLE001 - the tables are the main product; the trace is a bonus
            print(f"profile: rank {self.rank}: chrome trace not written ({type(err).__name__}: {err})".splitlines()[0],
                  flush=True)
        finally:
            Path(tmp).unlink(missing_ok=True)
