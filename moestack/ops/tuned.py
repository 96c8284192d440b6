"""Per-shape backend choices measured by `moestack tune`, read by the op dispatchers at run time.

`moestack tune` runs every available backend of each hot op (KDA, DSA sparse attention, MoE grouped GEMM) at the
shapes the model and plan produce, checks each against the reference, and records the fastest correct one here.
A dispatcher on "auto" (moestack/ops/backends.py) looks its op and shape up and takes the recorded backend if it
takes the call; otherwise it falls back to its fixed preference order. Every hit is remembered for the run record
(`hits()`, written to the run's kernels.json).

File: $MOESTACK_TUNE_CACHE (moestack/config/settings.py), else ~/.cache/moestack/tuned-ops.json. Entries are keyed by
device (GPU name, torch and Triton versions: a driver or compiler change can reorder backends), then op, then a shape
key built from the dimensions that decide the kernel choice (sequence lengths bucketed to powers of two).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import torch

from moestack.config.settings import TUNE_CACHE_ENV, tune_cache_path

ENV_VAR = TUNE_CACHE_ENV
_loaded: dict[str, tuple[float, dict]] = {}
_hits: dict[str, str] = {}  # "op|shape key" -> backend, every lookup that returned a choice in this process


def cache_path() -> Path:
    return tune_cache_path()


def hits() -> dict[str, str]:
    """The cache entries dispatchers followed in this process ("op|key" -> backend)."""
    return dict(_hits)


def device_key(device: torch.device | None = None) -> str:
    """GPU name + torch + Triton versions (one CPU key for interpreter runs)."""
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "none"
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
    else:
        name = "cpu"
    return f"{name}|torch {torch.__version__}|triton {tv}"


def bucket(n: int) -> int:
    """Round a length up to a power of two (choices are stable within a factor of two in length)."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def shape_key(**dims: int) -> str:
    return ",".join(f"{k}={dims[k]}" for k in sorted(dims))


def _read(path: Path) -> dict:
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return {}
    hit = _loaded.get(str(path))
    if hit is not None and hit[0] == mtime:
        return hit[1]
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        data = {}  # a broken cache only costs the tuned choice; the dispatcher's default order still works
    _loaded[str(path)] = (mtime, data)
    return data


def lookup(op: str, key: str, device: torch.device | None) -> str | None:
    """The recorded backend for (device, op, shape key), or None."""
    if device is None:
        return None
    entry = _read(cache_path()).get(device_key(device), {}).get(op, {}).get(key)
    backend = entry.get("backend") if isinstance(entry, dict) else None
    if backend is not None:
        _hits[f"{op}|{key}"] = backend
    return backend


def record(op: str, key: str, backend: str, timings_ms: dict[str, float], errors: dict[str, float],
           device: torch.device, path: Path | None = None) -> None:
    """Store the choice atomically (write a temp file, rename), keeping other devices' and ops' entries."""
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(_read(path))
    dev = data.setdefault(device_key(device), {})
    dev.setdefault(op, {})[key] = {"backend": backend, "ms": timings_ms, "rel_err": errors}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    _loaded.pop(str(path), None)


def kda_key(q: torch.Tensor) -> str:
    """q [B, T, H, K]: heads, head dim, bucketed tokens per batch row."""
    B, T, H, K = q.shape
    return shape_key(H=H, K=K, T=bucket(B * T))


def dsa_key(q: torch.Tensor, idx: torch.Tensor) -> str:
    """q [B, T, H, D], idx [B, T, k]: heads, latent width, top-k, bucketed tokens."""
    B, T, H, D = q.shape
    return shape_key(H=H, D=D, k=idx.shape[-1], T=bucket(B * T))


def grouped_mm_key(x: torch.Tensor, w: torch.Tensor) -> str:
    """x [N, D] rows, w [E, D, F]: experts, widths, bucketed rows per expert."""
    E, D, F = w.shape
    return shape_key(E=E, D=D, F=F, rows_per_expert=bucket(max(1, x.shape[0] // max(1, E))))
