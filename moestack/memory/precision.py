"""FP8 storage of saved activations (the inputs the expert GEMMs keep for their weight gradient).

Format: moestack.ops.fp8's 1x128 row tiles (the FP8 recipe's activation format: e4m3, max 448, one fp32 scale per
128 columns of a row = amax / 448; ops/fp8/reference.py). Round trip: every element within 2^-4 relative of the
original (3 mantissa bits, round to nearest), elements below their tile's amax * 2^-9 / 448 lose more (e4m3
subnormals), zero tiles stay zero. This is for experts on a bf16 strategy: a lossy saving (about half the bytes of
bf16) that only touches the experts' weight gradient. Under precision "fp8" the experts run the FP8 GEMMs, which
save their own FP8 copies, and memory/apply.py leaves this storage out.

`enable_fp8_expert_inputs(experts)` installs it on one Experts module (both grouped GEMMs: dispatched input and
activation output), through the expert GEMM seam of moestack.memory.offload.

Legend: N rows, D width, G = ceil(D / 128) tiles per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestack.ops.fp8.reference import FP8 as FP8_DTYPE
from moestack.ops.fp8.reference import FP8_MAX, FP8_REL_ERR, dequantize_rows, quantize_rows_ref

__all__ = ["FP8_DTYPE", "FP8_MAX", "FP8_REL_ERR", "Fp8Rows", "dequantize_rows_fp8", "enable_fp8_expert_inputs",
           "quantize_rows_fp8"]


@dataclass
class Fp8Rows:
    """A [N, D] tensor stored as fp8 values and fp32 scales per 1x128 tile; `dtype` is the original dtype."""

    data_ND: torch.Tensor  # float8_e4m3fn
    scale_NG: torch.Tensor  # fp32 [N, G]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.data_ND.numel() * self.data_ND.element_size() + self.scale_NG.numel() * 4


def quantize_rows_fp8(x_ND: torch.Tensor) -> Fp8Rows:
    """x [N, D] (any float dtype) -> Fp8Rows: ops/fp8's quantize_rows (its Triton kernel on CUDA, the torch spec
    elsewhere: the same numbers)."""
    assert x_ND.dim() == 2, f"expected [N, D], got {tuple(x_ND.shape)}"
    x = x_ND.detach()
    if x.is_cuda:
        from moestack.ops.fp8.quant import quantize_rows

        q, s = quantize_rows(x)
    else:
        q, s = quantize_rows_ref(x)
    return Fp8Rows(q, s, x_ND.dtype)


def dequantize_rows_fp8(q: Fp8Rows) -> torch.Tensor:
    """Fp8Rows -> [N, D] in the original dtype."""
    return dequantize_rows(q.data_ND, q.scale_NG).to(q.dtype)


def enable_fp8_expert_inputs(experts) -> None:
    """Store the inputs the expert GEMMs save for backward in FP8 (see module docstring). Composes with expert
    offload (moestack.memory.offload.ExpertOffload) in either order."""
    from moestack.memory.offload import expert_seam

    expert_seam(experts).fp8_inputs = True
