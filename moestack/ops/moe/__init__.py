"""MoE ops: routing, sort-based permute / combine, and the bf16 expert grouped GEMM behind REGISTRY.

The registry (moestack/ops/backends.py) selects the grouped GEMM, the one hot op (routing and permutation: routing.py,
its own registry). Backends, in the order "auto" tries them:
    "crossover": Triton (triton_grouped_gemm.py) at or below the measured crossover of mean rows per expert, else
                 torch (gemm_select.py); what "auto" runs on CUDA.
    "triton":    the Triton grouped GEMM at any row count, no host sync; CUDA or TRITON_INTERPRET=1; only by name.
    "torch":     torch's native grouped GEMM where supported (CUDA, bf16, aligned), else a padded-bmm or per-expert
                 fallback (reference.grouped_mm); what "auto" runs elsewhere.
    "reference": the per-expert loop (reference.grouped_mm_loop).
FP8 expert GEMMs are not a backend here: `precision: fp8` swaps the experts' GEMM strategy (moestack/ops/fp8).
The model's choice comes from KernelSpec.moe.gemm (Experts.gemm, set at build time). Under torch.compile
`grouped_mm` is one torch.library custom op (custom_ops.py: the same backend pick, the same backward kernels).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from moestack.ops import tuned
from moestack.ops.backends import Backend, ReferenceBackend, Registry
from moestack.ops.moe import custom_ops, reference
from moestack.ops.moe.reference import (
    Permutation,
    gather_sorted,
    grouped_mm_loop,
    moe_loop_reference,
    permute,
    route,
    unpermute_combine,
)
from moestack.ops.opaque import opaque


class TorchGemm(Backend):
    """torch's grouped GEMM (native where supported, else padded bmm / per-expert loop): every device."""

    name = "torch"

    @staticmethod
    def fn(x_ND, w_EDF, offs_E, table=None):
        return reference.grouped_mm(x_ND, w_EDF, offs_E)

    def prefers(self, device: torch.device) -> bool:
        return True


class TritonGemm(Backend):
    """triton_grouped_gemm.py at every row count (imported on first call); by name, or through "crossover"."""

    name = "triton"

    def unavailable(self, device: torch.device) -> str | None:
        from moestack.ops.kda import triton_runs_on

        return triton_runs_on(device)

    def prefers(self, device: torch.device) -> bool:
        return False

    @staticmethod
    def fn(x_ND, w_EDF, offs_E, table=None):
        return importlib.import_module("moestack.ops.moe.triton_grouped_gemm").grouped_mm(x_ND, w_EDF, offs_E)


class CrossoverGemm(Backend):
    """Triton up to the crossover rows per expert, torch above (gemm_select.py; `table` None = the built-in one)."""

    name = "crossover"

    @staticmethod
    def fn(x_ND, w_EDF, offs_E, table=None):
        return importlib.import_module("moestack.ops.moe.gemm_select").grouped_mm_auto(x_ND, w_EDF, offs_E, table)


REGISTRY = Registry("MoE grouped GEMM", tuned_op="moe.grouped_mm")
REGISTRY.register(CrossoverGemm())
REGISTRY.register(TritonGemm())
REGISTRY.register(TorchGemm())
REGISTRY.register(ReferenceBackend(lambda x_ND, w_EDF, offs_E, table=None: grouped_mm_loop(x_ND, w_EDF, offs_E)))


def available_backends(device: torch.device | None = None) -> list[str]:
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return [n for n in REGISTRY.names() if REGISTRY.get(n).unavailable(device) is None]


def resolve_backend(backend: str | None = None, x_ND: torch.Tensor | None = None) -> str:
    """The backend `grouped_mm` would use for x (default: an empty bf16 tensor on the current device)."""
    if x_ND is None:
        x_ND = torch.empty(0, 1, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    return REGISTRY.pick(backend, x_ND).name


def grouped_mm(
    x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, backend: str | None = None, table=None
) -> torch.Tensor:
    """out[rows of e] = x[rows of e] @ w[e] with the selected backend. x [N, D] sorted by expert, w [E, D, F],
    offs int32 [E] cumulative row ends. backend: a REGISTRY name or None / "auto"; table: the crossover table
    (gemm_select.CrossoverTable, None = built in). Returns [N, F]."""
    if torch.compiler.is_compiling() and x_ND.dim() == 2 and w_EDF.dim() == 3:
        from moestack.ops.moe.gemm_select import CrossoverTable

        if table is None or type(table) is CrossoverTable:  # the op takes the table as its row threshold here
            rows = None if table is None else int(table.threshold(w_EDF.shape[1], w_EDF.shape[2]))
            dtype = reference._compute_dtype(x_ND, w_EDF)  # the cast outside the op: its gradient in the graph
            return custom_ops.grouped_mm(x_ND.to(dtype), w_EDF.to(dtype), offs_E, backend, rows)
    return _grouped_mm_eager(x_ND, w_EDF, offs_E, backend, table)


def _grouped_mm_impl(x_ND, w_EDF, offs_E, backend, table) -> torch.Tensor:
    b = REGISTRY.pick(backend, x_ND, lambda: tuned.grouped_mm_key(x_ND, w_EDF))
    return b.fn(x_ND, w_EDF, offs_E, table)


_grouped_mm_eager = opaque(_grouped_mm_impl)


@dataclass
class GroupedGemm:
    """The experts' GEMM strategy (Experts.gemm): the bf16 registry with the KernelSpec's choice. A precision
    converter (moestack/ops/fp8) or the expert offload (moestack/memory/offload.py) replaces or wraps it."""

    backend: str = "auto"
    table: object | None = None  # gemm_select.CrossoverTable of KernelSpec.moe.crossover; None = built in

    def __call__(self, x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        return grouped_mm(x_ND, w_EDF, offs_E, self.backend, self.table)


__all__ = [
    "REGISTRY",
    "GroupedGemm",
    "Permutation",
    "available_backends",
    "gather_sorted",
    "grouped_mm",
    "grouped_mm_loop",
    "moe_loop_reference",
    "permute",
    "reference",
    "resolve_backend",
    "route",
    "unpermute_combine",
]
