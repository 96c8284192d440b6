"""The "auto" grouped GEMM: Triton for small experts, torch's grouped GEMM for large ones, by measured crossover.

The choice uses only host-known numbers: mean rows per expert N / E (no read of offs, so no host sync) and the
GEMM shape (D, F). Below or at the crossover the Triton kernel (moestack.ops.moe.triton_grouped_gemm) runs,
above it torch's. Crossovers come from `benchmarks/grouped_gemm.py --write-crossover PATH` (JSON, format below);
KernelSpec.moe.crossover names that file to use it, else the defaults here apply.

JSON: {"default_rows": 128, "by_shape": {"2048x2048": 256, ...}}  key "DxF" = GEMM in-width x out-width.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moestack.ops.moe import reference

# Defaults measured on one H200 (`benchmarks/grouped_gemm.py --small --write-crossover`, forward + backward): the
# TMA swap-AB kernels beat torch's grouped GEMM on K3's expert GEMMs up to 128 rows per expert (layer fwd+bwd 1.42x
# at 16, 1.30-1.38x at 32, 1.23-1.25x at 64, 1.05-1.09x at 128); on the smaller shapes (56 x 2048 -> 1024,
# 224 x 1024 -> 512) torch wins at every measured row count. A JSON written on the local GPU replaces these.
DEFAULT_ROWS = 0
DEFAULT_BY_SHAPE = {"3584x6144": 128, "3072x3584": 128}


@dataclass
class CrossoverTable:
    """Largest mean rows per expert at which Triton is chosen: per GEMM shape "DxF", else default_rows."""

    default_rows: int = DEFAULT_ROWS
    by_shape: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_BY_SHAPE))

    def threshold(self, D: int, F: int) -> int:
        return self.by_shape.get(f"{D}x{F}", self.default_rows)

    @classmethod
    def from_dict(cls, d: dict) -> CrossoverTable:
        if not isinstance(d.get("default_rows"), int):
            raise ValueError("crossover JSON: default_rows must be an int (mean rows per expert)")
        if "kernel" in d:
            raise ValueError("crossover JSON: 'kernel' is no longer a choice (the Triton grouped GEMM has one kernel "
                             "family since the refactor); remove the key")
        by_shape = {str(k): int(v) for k, v in d.get("by_shape", {}).items()}
        return cls(d["default_rows"], by_shape)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CrossoverTable:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def save(self, path: str | os.PathLike) -> None:
        d = {"default_rows": self.default_rows, "by_shape": self.by_shape}
        Path(path).write_text(json.dumps(d, indent=1))


@functools.cache
def default_table() -> CrossoverTable:
    """The built-in table (KernelSpec.moe.crossover names a JSON that replaces it: load_table)."""
    return CrossoverTable()


@functools.cache
def load_table(path: str | None) -> CrossoverTable:
    """The table of KernelSpec.moe.crossover (read once per path), or the built-in one for None."""
    return default_table() if path is None else CrossoverTable.load(path)


def choose(N: int, E: int, D: int, F: int, table: CrossoverTable | None = None) -> str:
    """"triton" when mean rows per expert N / E is at most the crossover for (D, F), else "torch"."""
    table = table or default_table()
    return "triton" if N <= table.threshold(D, F) * E else "torch"


def grouped_mm_auto(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor,
                    table: CrossoverTable | None = None) -> torch.Tensor:
    """The "crossover" backend (same contract as reference.grouped_mm). Triton only on CUDA in bf16 / fp16."""
    table = table or default_table()
    dtype = reference._compute_dtype(x_ND, w_EDF)
    small = choose(x_ND.shape[0], w_EDF.shape[0], w_EDF.shape[1], w_EDF.shape[2], table) == "triton"
    if small and x_ND.is_cuda and dtype in (torch.bfloat16, torch.float16):
        from moestack.ops.moe import triton_grouped_gemm

        return triton_grouped_gemm.grouped_mm(x_ND, w_EDF, offs_E)
    return reference.grouped_mm(x_ND, w_EDF, offs_E)
