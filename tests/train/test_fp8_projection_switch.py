"""The trainer's $MOESTACK_FP8_PROJ switch (Trainer._configure_fp8): converts exactly the latent projections, refuses
bad values and CPU runs without the Triton interpreter with one-line errors. The FP8 numerics are
tests/ops/test_moe_fp8_linear.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moestack.config import load_model_spec
from moestack.config.base import ConfigError
from moestack.model.transformer import build_model
from moestack.train.trainer import FP8_PROJ_ENV, Trainer


def _configure(model, device="cpu"):
    logs: list[str] = []
    trainer = SimpleNamespace(device=torch.device(device), log=logs.append, spec=SimpleNamespace(precision="auto"))
    Trainer._configure_fp8(trainer, model)
    return logs


def _fp8(model):
    return {n for n, m in model.named_modules() if type(m).__name__ == "Fp8Linear"}


def test_switch_off_by_default_and_on(monkeypatch):
    model = build_model(load_model_spec("tiny"), "cpu", seed=0)
    monkeypatch.delenv(FP8_PROJ_ENV, raising=False)
    assert _configure(model) == [] and not _fp8(model)
    monkeypatch.setenv(FP8_PROJ_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logs = _configure(model)
    moe = list(model.moe_layers())
    assert _fp8(model) == {f"layers.{n}.ffn.{p}" for n in moe for p in ("down_proj", "up_proj")}
    assert logs == [f"FP8 latent projections ({FP8_PROJ_ENV}=1): {2 * len(moe)} Linear layers"]
    others = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in _fp8(model)]
    assert others and all(type(m) is nn.Linear for m in others)  # attention, router, head, shared experts stay


def test_switch_errors(monkeypatch):
    model = build_model(load_model_spec("tiny"), "cpu", seed=0)
    monkeypatch.setenv(FP8_PROJ_ENV, "yes")
    with pytest.raises(ConfigError, match="MOESTACK_FP8_PROJ='yes': use 1"):
        _configure(model)
    monkeypatch.setenv(FP8_PROJ_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        _configure(model)
    assert not _fp8(model)
