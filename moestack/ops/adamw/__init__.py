"""AdamW's update as an op: the spec (reference.py) and one Triton pass that also writes the bf16 compute copy
(triton_adamw.py). KernelSpec.adamw.backend chooses it for the single-device trainer's optimizer
(moestack.train.optim.StreamingAdamW); README.md has the why and the measurements.
"""

from __future__ import annotations

import importlib.util

import torch

from moestack.ops.adamw.reference import adamw_reference

HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton pass cannot run on `device` (None: a GPU, or the interpreter for CPU tensors)."""
    from moestack.ops.kda import triton_runs_on

    return triton_runs_on(device)


def triton_takes(p: torch.Tensor, g: torch.Tensor, copy: torch.Tensor | None) -> bool:
    """Whether one parameter's update can run in the Triton pass: fp32 contiguous p (plain tensor), a dense fp32 /
    bf16 gradient of its shape, a bf16 contiguous copy."""
    return (HAS_TRITON and type(p.data) is torch.Tensor and p.dtype == torch.float32 and p.is_contiguous()
            and not g.is_sparse and g.dtype in (torch.float32, torch.bfloat16) and g.is_contiguous()
            and g.shape == p.shape and g.device == p.device and triton_unavailable(p.device) is None
            and (copy is None or (copy.dtype == torch.bfloat16 and copy.is_contiguous() and copy.shape == p.shape)))


def adamw_triton(*args, **kwargs) -> None:
    """triton_adamw.adamw_triton (imported on first use: the module builds its kernel at import)."""
    from moestack.ops.adamw.triton_adamw import adamw_triton as run

    run(*args, **kwargs)


__all__ = ["adamw_reference", "adamw_triton", "triton_takes", "triton_unavailable"]
