"""`moestack tune-comm`: measure collective bus bandwidth and latency inside one scale-up domain (under torchrun).

    torchrun --standalone --nproc-per-node 2 -m moestack tune-comm --out comm.json [--sizes-mib 1,16,128]
        [--iters 20] [--dtype fp32|bf16] [--merge-into calibration.json]
    moestack tune-comm --from comm.json --merge-into calibration.json      # merge an earlier measurement, no torchrun

What it measures: all_reduce ("ar"), reduce_scatter_tensor ("rs"), all_gather_into_tensor ("ag") and
all_to_all_single ("a2a") on every rank of the job (NCCL on CUDA, gloo on CPU), on random data, at each size (the
buffer: ar / a2a the per-rank tensor, rs the input, ag the output), after warm-up; each call is timed alone (ranks
aligned by a barrier first; CUDA events on GPU, perf_counter on CPU), the median over `iters` calls is taken and the
slowest rank's median kept. Times become NCCL's bus bandwidth (nccl-tests PERFORMANCE.md): ar 2(n-1)/n * bytes / t,
rs / ag (n-1)/n * total bytes / t, a2a (n-1)/n * bytes / t; a least-squares line t = a + b * bytes over the sizes
(a >= 0) gives the per-call latency a. Rank 0 writes

    {"world": n, "backend": "nccl", "device": "...", "date": "...", "dtype": "fp32", "iters": 20, "nccl_env": {...},
     "collectives": {"ar": {"busbw_gb_s": <at the largest size>, "latency_us": a * 1e6,
                            "points": [[bytes, seconds], ...]}, "rs": ..., "ag": ..., "a2a": ...}}

`--merge-into CAL.json` then sets CAL.json's `comm` field (calibration.CommCalibration; CAL.json is rewritten
atomically; when it does not exist the default calibration is the base), which the cost model uses for every
collective whose group stays inside tier 0 (planner/cost/comm.py `_measured`). Why: the datasheet bandwidth times an
efficiency is a guess per machine (benchmarks/RESULTS.md, "Multi-GPU": a VM's NVLink pair ran over P2P/CUMEM). NVLink
multicast env vars (NCCL_NVLS_ENABLE etc.) are left as the caller set them.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

from moestack.config.base import ConfigError
from moestack.planner.calibration import (
    COLLECTIVE_KINDS,
    CommCalibration,
    load_calibration,
    save_calibration,
)

DEFAULT_SIZES_MIB = (1.0, 16.0, 128.0)
CPU_SIZES_MIB = (0.0625, 0.25, 1.0)  # what the CPU dry runs use (gloo over host memory is slow)


def busbw_factor(kind: str, n: int) -> float:
    """NCCL's bus bandwidth factor: busbw = factor * bytes / t (bytes: the per-rank buffer, total for rs / ag)."""
    return (2.0 if kind == "ar" else 1.0) * (n - 1) / n


def fit_latency(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t = a + b * bytes over (bytes, seconds) points, a clamped to >= 0 (then b refitted through the
    origin); one point: a = 0. Returns (a seconds, b seconds per byte)."""
    xs = [float(x) for x, _ in points]
    ts = [float(t) for _, t in points]
    n = len(xs)
    if n >= 2:
        mx, mt = sum(xs) / n, sum(ts) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx > 0:
            b = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx
            a = mt - b * mx
            if a >= 0 and b > 0:
                return a, b
    b = sum(x * t for x, t in zip(xs, ts)) / max(sum(x * x for x in xs), 1e-30)
    return 0.0, b


def _in_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _require_world() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    elif _in_torchrun():
        world = int(os.environ["WORLD_SIZE"])
    else:
        world = 1
    if world < 2:
        raise ConfigError(f"tune-comm: needs 2 or more ranks (world size {world}); launch it under torchrun, e.g. "
                          "`torchrun --standalone --nproc-per-node 2 -m moestack tune-comm --out comm.json`")


def _init() -> tuple[str, object, bool]:
    """(backend, device, whether this call created the process group)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        backend = dist.get_backend()
        if backend == "nccl":
            return backend, torch.device("cuda", torch.cuda.current_device()), False
        return backend, torch.device("cpu"), False
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
        return "nccl", device, True
    dist.init_process_group("gloo")
    return "gloo", torch.device("cpu"), True


def _collective(kind: str, nbytes: int, n: int, dtype, device):
    """A closure running one collective of `kind` on a buffer of about `nbytes` (rounded to n elements)."""
    import torch
    import torch.distributed as dist

    esize = torch.empty((), dtype=dtype).element_size()
    numel = max(n, (int(nbytes) // esize) // n * n)
    gen = torch.Generator(device="cpu").manual_seed(1234 + dist.get_rank())

    def rand(k: int):
        return torch.randn(k, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    if kind == "ar":
        x = rand(numel)
        return numel * esize, lambda: dist.all_reduce(x)
    if kind == "rs":
        x, y = rand(numel), torch.empty(numel // n, device=device, dtype=dtype)
        return numel * esize, lambda: dist.reduce_scatter_tensor(y, x)
    if kind == "ag":
        x, y = rand(numel // n), torch.empty(numel, device=device, dtype=dtype)
        return numel * esize, lambda: dist.all_gather_into_tensor(y, x)
    if kind == "a2a":
        x, y = rand(numel), torch.empty(numel, device=device, dtype=dtype)
        return numel * esize, lambda: dist.all_to_all_single(y, x)
    raise ValueError(f"unknown collective {kind!r}")


def _time_calls(fn, iters: int, warmup: int, device) -> float:
    """Median seconds of one call of fn, slowest rank's median (every rank returns the same number); each timed
    call starts after a barrier."""
    import torch
    import torch.distributed as dist

    from moestack.tune.timer import median_seconds

    med = median_seconds(fn, reps=iters, warmup=warmup, device=device, before_each=dist.barrier)
    out = torch.tensor([med], dtype=torch.float64, device=device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out.item())


def measure(sizes_mib: list[float] | None = None, iters: int = 20, warmup: int = 5, dtype: str = "fp32") -> dict:
    """Measure the four collectives on the current process group (initialised here from torchrun's env when needed);
    every rank returns the same dict (the JSON tune-comm writes)."""
    import torch
    import torch.distributed as dist

    _require_world()
    backend, device, _ = _init()
    n = dist.get_world_size()
    if sizes_mib is None:
        sizes_mib = list(DEFAULT_SIZES_MIB if device.type == "cuda" else CPU_SIZES_MIB)
    if not sizes_mib or any(s <= 0 for s in sizes_mib):
        raise ConfigError(f"tune-comm: --sizes-mib: positive sizes in MiB expected (got {sizes_mib})")
    if iters < 1:
        raise ConfigError(f"tune-comm: --iters: must be >= 1 (got {iters})")
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dtype)
    if tdtype is None:
        raise ConfigError(f"tune-comm: --dtype: fp32 | bf16 (got {dtype!r})")
    collectives = {}
    for kind in COLLECTIVE_KINDS:
        points = []
        for mib in sorted(sizes_mib):
            nbytes, fn = _collective(kind, int(mib * 2**20), n, tdtype, device)
            points.append((nbytes, _time_calls(fn, iters, warmup, device)))
            del fn
        a, _ = fit_latency(points)
        big_bytes, big_t = points[-1]
        collectives[kind] = {"busbw_gb_s": busbw_factor(kind, n) * big_bytes / big_t / 1e9,
                             "latency_us": a * 1e6, "points": [[b, t] for b, t in points]}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return {"world": n, "backend": backend, "device": name,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "dtype": dtype,
            "iters": iters, "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
            "collectives": collectives}


def comm_calibration(data: dict, source: str = "") -> CommCalibration:
    """The calibration field from a tune-comm JSON (validated: one-line ConfigError on a bad file)."""
    from moestack.config.base import validate

    if not isinstance(data, dict) or "collectives" not in data:
        raise ConfigError(f"tune-comm: {source or 'data'}: not a tune-comm JSON (no 'collectives')")
    colls = {k: {"busbw_gb_s": v.get("busbw_gb_s"), "latency_us": v.get("latency_us", 0.0)}
             for k, v in data["collectives"].items()} if isinstance(data["collectives"], dict) else data["collectives"]
    src = f"moestack tune-comm {data.get('date', '')}".strip() + (f" ({source})" if source else "")
    return validate(CommCalibration, {"source": src, "world": data.get("world"), "tier": 0,
                                      "backend": data.get("backend", ""), "device": data.get("device", ""),
                                      "collectives": colls}, f"tune-comm {source or 'result'}")


def merge_into(cal_path: str | Path, data: dict, source: str = "") -> CommCalibration:
    """Set `comm` of the calibration at cal_path (the default calibration when the file does not exist) from a
    tune-comm result and rewrite the file atomically."""
    comm = comm_calibration(data, source)
    p = Path(cal_path)
    cal = load_calibration(p if p.exists() else None)
    cal.comm = comm
    save_calibration(cal, p)
    return comm


def table_row(data: dict) -> str:
    """| tune-comm | world | backend | ar GB/s | rs GB/s | ag GB/s | a2a GB/s | (busbw at the largest size, latency)"""
    c = data["collectives"]
    cells = " | ".join(f"{k} {c[k]['busbw_gb_s']:.1f} GB/s ({c[k]['latency_us']:.0f} us)" for k in COLLECTIVE_KINDS
                       if k in c)
    return f"| tune-comm | {data['world']} x {data['device']} ({data['backend']}) | {cells} |"


def run_tune_comm(out: Path | None, sizes_mib: list[float] | None = None, iters: int = 20, warmup: int = 5,
                  dtype: str = "fp32", merge: Path | None = None, from_file: Path | None = None) -> dict | None:
    """The CLI: measure (under torchrun) or read `from_file`; rank 0 writes `out`, merges into `merge`, prints the
    table row. Returns the result on rank 0 (None on other ranks)."""
    if from_file is not None:
        if merge is None:
            raise ConfigError("tune-comm: --from needs --merge-into CAL.json (nothing to measure or write otherwise)")
        if not from_file.is_file():
            raise ConfigError(f"tune-comm: {from_file}: file not found")
        try:
            data = json.loads(from_file.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"tune-comm: {from_file}: not valid JSON ({err.msg} at line {err.lineno})") from None
        merge_into(merge, data, str(from_file))
        print(f"merged {from_file} into {merge}")
        return data
    if out is None and merge is None:
        raise ConfigError("tune-comm: give --out FILE and/or --merge-into CAL.json")
    import torch.distributed as dist

    _require_world()
    created = not dist.is_initialized()
    try:
        data = measure(sizes_mib, iters, warmup, dtype)
        rank = dist.get_rank()
        if rank == 0:
            if out is not None:
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
                tmp.write_text(json.dumps(data, indent=2) + "\n")
                os.replace(tmp, out)
            if merge is not None:
                merge_into(merge, data, str(out) if out is not None else "")
            print(table_row(data))
            if out is not None:
                print(f"wrote {out}" + (f"; merged into {merge}" if merge is not None else ""))
            elif merge is not None:
                print(f"merged into {merge}")
        dist.barrier()
        return data if rank == 0 else None
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def parse_sizes(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"tune-comm: --sizes-mib: comma list of MiB expected, e.g. 1,16,128 (got {text!r})") from None
