"""Refuse, in one line, a single-device run whose fp32 weights alone exceed the device's memory (a 2.8T model on a
CPU would otherwise die in the allocator with a traceback several minutes into the build)."""

from __future__ import annotations

import os

import torch

from moestack.config.base import ConfigError
from moestack.config.model_spec import ModelSpec

TIB = 2**40
GIB = 2**30


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of `device` (CUDA: the GPU's; CPU: physical RAM); None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def check_single_device_fits(spec: ModelSpec, device: torch.device) -> None:
    """ConfigError when the model's fp32 parameters (4 B each; training adds gradients and AdamW state, 16 B in all)
    do not fit in `device`'s memory. Only certain failures are refused: a model that passes may still run out of
    memory later (activations, optimizer), which `moestack plan` predicts."""
    from moestack.planner.profile import profile_model

    capacity = device_memory_bytes(device)
    if capacity is None:
        return
    params = profile_model(spec, 1).total_params
    if 4 * params <= capacity:
        return
    need = lambda b: f"{b / TIB:.1f} TiB" if b >= TIB else f"{b / GIB:.1f} GiB"  # noqa: E731
    raise ConfigError(
        f"model '{spec.name}': {params / 1e9:,.1f}B parameters need {need(4 * params)} of fp32 weights alone "
        f"({need(16 * params)} with gradients and AdamW state) but this {device.type} has {need(capacity)}: train "
        "it on many devices with a plan (`moestack plan MODEL --cluster ...`, then torchrun ... --plan plan.yaml) "
        "or a scaled-down proxy (`moestack adapt MODEL --fit ...`)")
