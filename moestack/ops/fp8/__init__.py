"""FP8 (e4m3, DeepSeek-V3's fine-grained scales) for training: quantisers, the weight cache, the grouped and dense
FP8 GEMMs, and the one precision converter `precision: fp8` applies (README.md).

    reference.py     the torch spec of the three groupings (1x128 rows, 128x128 blocks, 128x1 token tiles)
    quant.py         the Triton quantisers (quantize_dual: both activation copies in one read; gluon_quant.py on
                     sm_90); quantize_rows is also memory/precision.py's activation-storage format
    weight_cache.py  fp8 weights once per optimizer step and parameter version
    scaled_mm.py     per-expert cuBLAS blockwise GEMMs (many rows per expert)
    grouped_gemm.py  the expert GEMM (Fp8GroupedMM) and the experts' strategy Fp8GroupedGemm
    linear.py        Fp8Linear: a Linear as a one-expert grouped GEMM
    convert.py       convert_precision / apply_fp8_recipe: the model-level conversion
"""

from __future__ import annotations

import importlib.util
import os

import torch


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


__all__ = ["fp8_unavailable_reason"]
