"""The single-device size check: a model whose fp32 weights cannot fit is refused in one line before the build."""

from __future__ import annotations

import pytest
import torch

from moestack.config import ConfigError, load_model_spec
from moestack.train import fits


def test_kimi_k3_on_one_device_is_refused_by_size(monkeypatch):
    monkeypatch.setattr(fits, "device_memory_bytes", lambda device: 512 * fits.GIB)
    with pytest.raises(ConfigError) as err:
        fits.check_single_device_fits(load_model_spec("kimi-k3"), torch.device("cpu"))
    msg = str(err.value)
    assert "\n" not in msg and "kimi-k3" in msg and "10.1 TiB" in msg and "512.0 GiB" in msg and "plan" in msg
    fits.check_single_device_fits(load_model_spec("tiny"), torch.device("cpu"))  # fits: no error


def test_unknown_capacity_is_not_refused(monkeypatch):
    monkeypatch.setattr(fits, "device_memory_bytes", lambda device: None)
    fits.check_single_device_fits(load_model_spec("kimi-k3"), torch.device("cpu"))
