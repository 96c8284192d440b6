"""Helpers shared by the grouped-GEMM tests (bf16 Triton and FP8): the relative error and group offsets."""

from __future__ import annotations

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def offs_from_counts(counts: list[int], device=DEV) -> torch.Tensor:
    """Cumulative int32 group ends from rows per group (torch._grouped_mm's offs)."""
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
