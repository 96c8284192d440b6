"""The tuned-ops cache: record / lookup, device keys, and dispatchers following a recorded choice."""

from __future__ import annotations

import json

import pytest
import torch

from moestack.ops import moe, tuned


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    monkeypatch.setenv(tuned.ENV_VAR, str(path))
    monkeypatch.delenv(moe.ENV_VAR, raising=False)
    return path


def test_record_then_lookup_roundtrip(cache):
    cpu = torch.device("cpu")
    key = tuned.shape_key(H=4, T=tuned.bucket(300))
    assert key == "H=4,T=512"
    assert tuned.lookup("kda", key, cpu) is None
    tuned.record("kda", key, "reference", {"reference": 1.5}, {"reference": 0.0}, cpu)
    assert tuned.lookup("kda", key, cpu) == "reference"
    assert tuned.lookup("kda", "H=8,T=512", cpu) is None
    data = json.loads(cache.read_text())
    assert list(data) == [tuned.device_key(cpu)]  # keyed by device + versions
    tuned.record("dsa.sparse_mqa_attention", "k=4", "reference", {}, {}, cpu)  # other ops' entries are kept
    assert tuned.lookup("kda", key, cpu) == "reference"


def test_broken_cache_falls_back(cache):
    cache.write_text("{not json")
    assert tuned.lookup("kda", "H=1", torch.device("cpu")) is None


def test_grouped_mm_dispatch_follows_the_recorded_backend(cache, monkeypatch):
    x, w = torch.randn(10, 4), torch.randn(3, 4, 5)
    offs = torch.tensor([3, 7, 10], dtype=torch.int32)
    calls = []
    monkeypatch.setitem(moe._BACKENDS, "spy", (lambda *a: calls.append(1) or moe.grouped_mm_loop(*a), lambda: True))
    torch.testing.assert_close(moe.grouped_mm(x, w, offs), moe.grouped_mm_loop(x, w, offs))
    assert not calls
    tuned.record("moe.grouped_mm", tuned.grouped_mm_key(x, w), "spy", {}, {}, torch.device("cpu"))
    torch.testing.assert_close(moe.grouped_mm(x, w, offs), moe.grouped_mm_loop(x, w, offs))
    assert calls == [1]
    monkeypatch.setenv(moe.ENV_VAR, "reference")  # an explicit choice still wins
    moe.grouped_mm(x, w, offs)
    assert calls == [1]
