"""KDA op: `chunk_kda` dispatches to a registered backend.

Backends (see README.md):
    "reference"  kda_chunked_reference, pure PyTorch, always available (CPU training fallback)
    "fla"        fla.ops.kda.chunk_kda, only when `fla` is importable (a public anchor for benchmarks)
    "triton"     ours (triton_op.py registers itself; imported lazily on first dispatch, see _LAZY_BACKENDS)

Selection: the explicit `backend` argument, else the env var MOESTACK_KDA_BACKEND, else the first backend of
AUTO_ORDER that is available and supports the inputs.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from moestack.ops import tuned
from moestack.ops.opaque import opaque

from moestack.ops.kda.reference import (
    kda_chunked_reference,
    kda_gate_k3,
    kda_gate_kimi_linear,
    kda_recurrent_reference,
)

__all__ = [
    "AUTO_ORDER",
    "ENV_VAR",
    "chunk_kda",
    "kda_chunked_reference",
    "kda_gate_k3",
    "kda_gate_kimi_linear",
    "kda_recurrent_reference",
    "register_backend",
    "registered_backends",
    "resolve_backend",
]

ENV_VAR = "MOESTACK_KDA_BACKEND"
# "triton" first: it is picked for CUDA inputs (triton_supports). It was opt-in for a while after in-model bf16
# training went non-finite on the H200 (2026-11-29); the cause was the power-series triangular inverse, which
# loses every digit for correlated keys (tests/ops/test_kda_triton.py::test_correlated_keys_weak_gates).
AUTO_ORDER = ("triton", "reference")

# fn(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, chunk_size) -> (o, final_state)
KDAFn = Callable[..., tuple[torch.Tensor, "torch.Tensor | None"]]


@dataclass(frozen=True)
class _Backend:
    fn: KDAFn
    available: Callable[[], bool]  # installed / importable at all
    supports: Callable[[torch.Tensor], bool] | None  # can it run these inputs (device, dtype)? None = any


_BACKENDS: dict[str, _Backend] = {}


def _triton_may_run() -> bool:
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


# Backends whose module registers itself on import: name -> (module, package it needs, may it run here?).
# Imported on first use, not at package import (so TRITON_INTERPRET set by a test module is seen before kernels
# are decorated), and only where they can run (or when asked for by name): importing the Triton kernels on a
# machine without a GPU would switch the whole process to the slow Triton interpreter.
_LAZY_BACKENDS = {"triton": ("moestack.ops.kda.triton_op", "triton", _triton_may_run)}


def _load_lazy_backends(force: str | None = None) -> None:
    for name, (module, needs, may_run) in _LAZY_BACKENDS.items():
        if name in _BACKENDS or importlib.util.find_spec(needs) is None:
            continue
        if name == force or may_run():
            importlib.import_module(module)


def register_backend(
    name: str,
    fn: KDAFn,
    available: Callable[[], bool],
    supports: Callable[[torch.Tensor], bool] | None = None,
) -> None:
    """Register (or replace) a backend.

    fn is called as fn(q, k, v, g, beta, scale=, initial_state=, output_final_state=, cu_seqlens=, chunk_size=)
    with the shapes of `chunk_kda` and returns (o [B, T, H, V], final_state [N, H, K, V] fp32 or None); it may
    ignore chunk_size (a tuning knob, not part of the math). `available()` says whether it can run at all;
    `supports(q)` (optional) whether it can run these inputs; auto-selection skips it when either is False.
    """
    _BACKENDS[name] = _Backend(fn, available, supports)


def registered_backends() -> list[str]:
    _load_lazy_backends()
    return sorted(_BACKENDS)


def resolve_backend(backend: str | None = None, q: torch.Tensor | None = None) -> str:
    """The backend `chunk_kda` would use: explicit name > $MOESTACK_KDA_BACKEND > first usable of AUTO_ORDER."""
    name = backend or os.environ.get(ENV_VAR) or None
    _load_lazy_backends(force=name)
    if name is not None:
        if name not in _BACKENDS:
            source = "backend argument" if backend else f"${ENV_VAR}"
            raise ValueError(f"unknown KDA backend '{name}' ({source}); valid: {', '.join(registered_backends())}")
        if not _BACKENDS[name].available():
            raise RuntimeError(f"KDA backend '{name}' is registered but not available here (not installed?)")
        return name
    if q is not None:  # a choice measured by `moestack tune` at this shape wins over the fixed order
        choice = tuned.lookup("kda", tuned.kda_key(q), q.device)
        b = _BACKENDS.get(choice) if choice else None
        if b is not None and b.available() and (b.supports is None or b.supports(q)):
            return choice
    for cand in AUTO_ORDER:
        b = _BACKENDS.get(cand)
        if b is not None and b.available() and (q is None or b.supports is None or b.supports(q)):
            return cand
    raise RuntimeError(f"no KDA backend of {AUTO_ORDER} is usable; registered: {registered_backends()}")


@opaque
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention, chunked. Layout as fla; q and k already L2-normalised by the caller.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (<= 0, already activated); beta: [B, T, H].
    scale defaults to K ** -0.5; initial_state [N, H, K, V]; cu_seqlens int [N + 1] offsets (B == 1).
    Returns (o [B, T, H, V] in v.dtype, final_state [N, H, K, V] fp32 or None).
    """
    if is_fake(q):
        return _shapes_only(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens)
    name = resolve_backend(backend, q)
    return _BACKENDS[name].fn(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )


def _shapes_only(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens):
    """A dry run (fake tensors, moestack/train/dry_run.py: shapes, no values): outputs of the right shapes and dtypes
    that depend on every input, so backward reaches each of them, in a handful of ops instead of the reference's
    chunk loop (~2 ms per op on fake tensors: the loop was half of a K3 stage's dry run). Not KDA's math."""
    B, T, H, K = q.shape
    mix = (q * k * g.exp()).sum(-1, keepdim=True) * beta.unsqueeze(-1)  # [B, T, H, 1]
    o = (v * mix).to(v.dtype)
    if not output_final_state:
        return o, None
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    S = torch.einsum("bthk,bthv->bhkv", k.float(), v.float()).sum(0, keepdim=True).expand(N, H, K, v.shape[-1])
    return o, S + initial_state.float() if initial_state is not None else S


# ---- built-in backends -----------------------------------------------------------------------------------------


def _fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def _fla_chunk_kda(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
    from fla.ops.kda import chunk_kda as fla_chunk_kda  # imported lazily: optional dependency

    del chunk_size  # fla picks its own (64)
    if initial_state is not None:
        initial_state = initial_state.float()  # fla keeps the recurrent state in fp32
    return fla_chunk_kda(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
    )


register_backend("reference", kda_chunked_reference, available=lambda: True)
register_backend("fla", _fla_chunk_kda, available=_fla_available, supports=lambda q: q.is_cuda)
