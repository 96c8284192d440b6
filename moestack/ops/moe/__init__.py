"""MoE ops: routing, sort-based permute / combine, and the grouped GEMM behind a small backend registry.

The registry selects the grouped GEMM, the one hot op (routing and permutation are cheap torch ops from
reference.py, shared by every backend). Backends:
    "torch":     torch's native grouped GEMM where supported (CUDA, bf16, aligned), else a padded-bmm or
                 per-expert fallback (reference.grouped_mm); always available.
    "reference": the per-expert loop (reference.grouped_mm_loop); always available.
    "triton":    Triton grouped GEMM (triton_grouped_gemm.py), persistent, no host sync; CUDA or TRITON_INTERPRET=1.
    "auto":      triton at or below the measured crossover of mean rows per expert, else torch (gemm_select.py).
    "fp8":       e4m3 blockwise-scaled expert GEMMs, 1x128 activation tiles, 128x128 weight blocks
                 (fp8_grouped_gemm.py); sm_89+ GPUs (TRITON_INTERPRET=1 on CPU), never chosen by default
                 (precision fp8 sets it: moestack/train/fp8.py).
Selection: explicit `backend` argument > env MOESTACK_MOE_BACKEND > first available of PREFERENCE
("auto" leads only on CUDA; triton and fp8 are chosen by name or through auto).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable

import torch

from moestack.ops import tuned
from moestack.ops.moe import reference
from moestack.ops.opaque import opaque
from moestack.ops.moe.reference import (
    Permutation,
    gather_sorted,
    grouped_mm_loop,
    moe_loop_reference,
    permute,
    route,
    unpermute_combine,
)

GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

ENV_VAR = "MOESTACK_MOE_BACKEND"
PREFERENCE = ("auto", "torch", "reference") if torch.cuda.is_available() else ("torch", "reference")
_BACKENDS: dict[str, tuple[GroupedMM, Callable[[], bool]]] = {}


def register_backend(name: str, fn: GroupedMM, available: Callable[[], bool] = lambda: True) -> None:
    """Register a grouped GEMM `fn(x_ND, w_EDF, offs_E int32) -> [N, F]` (see reference.grouped_mm for the
    contract); `available()` says whether it can run in this process."""
    _BACKENDS[name] = (fn, available)


def available_backends() -> list[str]:
    return [name for name, (_, available) in _BACKENDS.items() if available()]


def resolve_backend(backend: str | None = None) -> str:
    """The backend name to use: explicit > env MOESTACK_MOE_BACKEND > first available of PREFERENCE."""
    name = backend or os.environ.get(ENV_VAR) or None
    if name is not None:
        if name not in _BACKENDS:
            raise ValueError(f"unknown MoE backend {name!r}; registered: {sorted(_BACKENDS)}")
        if not _BACKENDS[name][1]():
            raise ValueError(f"MoE backend {name!r} is not available here; available: {available_backends()}")
        return name
    for name in PREFERENCE:
        if name in _BACKENDS and _BACKENDS[name][1]():
            return name
    raise AssertionError("the reference backend is always available")


@opaque
def grouped_mm(
    x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, backend: str | None = None
) -> torch.Tensor:
    """out[rows of e] = x[rows of e] @ w[e] with the selected backend. x [N, D] sorted by expert, w [E, D, F],
    offs int32 [E] cumulative row ends. Returns [N, F]."""
    if backend is None and not os.environ.get(ENV_VAR):  # a choice measured by `moestack tune` at this shape
        choice = tuned.lookup("moe.grouped_mm", tuned.grouped_mm_key(x_ND, w_EDF), x_ND.device)
        if choice in _BACKENDS and _BACKENDS[choice][1]():
            backend = choice
    return _BACKENDS[resolve_backend(backend)][0](x_ND, w_EDF, offs_E)


@opaque
def expert_ffn(
    x_ND: torch.Tensor, w_gu_ED2I: torch.Tensor, w_down_EID: torch.Tensor, offs_E: torch.Tensor,
    backend: str | None, kind: str, beta: float, lin_beta: float,
) -> torch.Tensor | None:
    """The whole expert FFN act(x w_gu) w_down as one fused op where the backend has one and it applies (the fp8
    backend's v3 path: fp8_expert_ffn.py); None = run the two grouped GEMMs and the activation separately."""
    if (backend or os.environ.get(ENV_VAR)) != "fp8" or not _fp8_available():
        return None
    from moestack.ops.moe import fp8_expert_ffn

    return fp8_expert_ffn.expert_ffn(x_ND, w_gu_ED2I, w_down_EID, offs_E, kind, beta, lin_beta)


register_backend("torch", reference.grouped_mm)
register_backend("reference", grouped_mm_loop)


def _lazy(module: str, attr: str) -> GroupedMM:
    """Import the kernel module on first call, so TRITON_INTERPRET set by a test before that call is seen."""

    def fn(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        return getattr(importlib.import_module(module), attr)(x_ND, w_EDF, offs_E)

    return fn


def _triton_available() -> bool:
    has_triton = importlib.util.find_spec("triton") is not None
    return has_triton and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1")


def fp8_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the FP8 kernels cannot run on `device` (default: the current GPU, else the CPU); None = they can: sm_89+
    GPUs, and on CPU only under TRITON_INTERPRET=1 (slow checks of the kernels' logic)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return f"{torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]}) has no FP8 tensor cores (sm_89+)"
        return None
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return None
    return f"the device is {device.type}: the FP8 kernels need a CUDA GPU (or TRITON_INTERPRET=1 for a slow check)"


def _fp8_available() -> bool:
    return fp8_unavailable_reason() is None


register_backend("triton", _lazy("moestack.ops.moe.triton_grouped_gemm", "grouped_mm"), _triton_available)
register_backend("auto", _lazy("moestack.ops.moe.gemm_select", "grouped_mm_auto"))
register_backend("fp8", _lazy("moestack.ops.moe.fp8_grouped_gemm", "grouped_mm"), _fp8_available)

__all__ = [
    "ENV_VAR",
    "PREFERENCE",
    "Permutation",
    "available_backends",
    "expert_ffn",
    "fp8_unavailable_reason",
    "gather_sorted",
    "grouped_mm",
    "grouped_mm_loop",
    "moe_loop_reference",
    "permute",
    "reference",
    "register_backend",
    "resolve_backend",
    "route",
    "unpermute_combine",
]
