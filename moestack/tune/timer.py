"""Median time of a callable: CUDA events on a GPU (what the device spent, launches overlapped as in a run), wall
clock on CPU (smoke runs). Shared by `moestack tune`'s measurements."""

from __future__ import annotations

import time

import torch


def median_seconds(fn, reps: int = 20, warmup: int = 0, device: torch.device | str = "cuda",
                   before_each=None) -> float:
    """Run fn() `warmup` times, then `reps` timed times; the median in seconds. `before_each` (untimed) runs before
    every timed call, followed by a device sync on CUDA (collectives: a barrier, so all ranks start together)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        if before_each is not None:
            before_each()
            if cuda:
                torch.cuda.synchronize(device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]
