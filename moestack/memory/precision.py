"""FP8 storage of saved activations (the inputs the expert GEMMs keep for their weight gradient).

Format: float8 e4m3 (max 448) with one fp32 scale per row, scale = amax(|row|) / 448. Round trip: every element is
within 2^-4 relative of the original (3 mantissa bits, round to nearest), elements below the row's
amax * 2^-9 / 448 lose more (e4m3 subnormals), rows of zeros stay zero. This is for experts on a bf16 backend: a
lossy saving (half the bytes of bf16) that only touches the experts' weight gradient. Under precision "fp8"
(moestack/train/fp8.py) the experts run the fp8 backend, which saves its own FP8 copies, and memory/apply.py leaves
this storage out.

`enable_fp8_expert_inputs(experts)` installs it on one Experts module (both grouped GEMMs: dispatched input and
activation output), through the expert GEMM seam of moestack.memory.offload.

Legend: N rows, D width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_REL_ERR = 2.0**-4  # round-to-nearest with 3 mantissa bits: |q - x| <= 2^-4 |x| for normal values


@dataclass
class Fp8Rows:
    """A [N, D] tensor stored as fp8 values and per-row fp32 scales; `dtype` is the original dtype."""

    data_ND: torch.Tensor  # float8_e4m3fn
    scale_N1: torch.Tensor  # fp32
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.data_ND.numel() * self.data_ND.element_size() + self.scale_N1.numel() * 4


def quantize_rows_fp8(x_ND: torch.Tensor) -> Fp8Rows:
    """x [N, D] (any float dtype) -> Fp8Rows with scale_n = amax(|x_n|) / 448 (1 for an all-zero row)."""
    assert x_ND.dim() == 2, f"expected [N, D], got {tuple(x_ND.shape)}"
    x32 = x_ND.detach().float()
    amax_N1 = x32.abs().amax(dim=1, keepdim=True)
    scale_N1 = torch.where(amax_N1 > 0, amax_N1 / FP8_MAX, torch.ones_like(amax_N1))
    data = (x32 / scale_N1).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Rows(data, scale_N1, x_ND.dtype)


def dequantize_rows_fp8(q: Fp8Rows) -> torch.Tensor:
    """Fp8Rows -> [N, D] in the original dtype."""
    return (q.data_ND.float() * q.scale_N1).to(q.dtype)


def enable_fp8_expert_inputs(experts) -> None:
    """Store the inputs the expert GEMMs save for backward in FP8 (see module docstring). Composes with expert
    offload (moestack.memory.offload.ExpertOffload) in either order."""
    from moestack.memory.offload import expert_seam

    expert_seam(experts).fp8_inputs = True
