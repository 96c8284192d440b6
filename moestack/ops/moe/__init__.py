"""MoE ops: routing, sort-based permute / combine, and the grouped GEMM behind a small backend registry.

The registry selects the grouped GEMM, the one hot op (routing and permutation are cheap torch ops from
reference.py, shared by every backend). Backends:
    "torch":     torch's native grouped GEMM where supported (CUDA, bf16, aligned), else a padded-bmm or
                 per-expert fallback (reference.grouped_mm); always available.
    "reference": the per-expert loop (reference.grouped_mm_loop); always available.
    "triton":    not registered yet; a Triton / FP8 grouped GEMM registers itself here.
Selection: explicit `backend` argument > env MOESTACK_MOE_BACKEND > first available of PREFERENCE.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from moestack.ops.moe import reference
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
PREFERENCE = ("triton", "torch", "reference")
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


def grouped_mm(
    x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, backend: str | None = None
) -> torch.Tensor:
    """out[rows of e] = x[rows of e] @ w[e] with the selected backend. x [N, D] sorted by expert, w [E, D, F],
    offs int32 [E] cumulative row ends. Returns [N, F]."""
    return _BACKENDS[resolve_backend(backend)][0](x_ND, w_EDF, offs_E)


register_backend("torch", reference.grouped_mm)
register_backend("reference", grouped_mm_loop)

__all__ = [
    "ENV_VAR",
    "PREFERENCE",
    "Permutation",
    "available_backends",
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
