"""The tuned-ops cache: record / lookup, device keys, and dispatchers following a recorded choice."""

from __future__ import annotations

import json

import pytest
import torch

from moestack.ops import moe, tuned
from moestack.ops.backends import Backend


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    monkeypatch.setenv(tuned.ENV_VAR, str(path))
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


class _Spy(Backend):
    name = "spy"

    def __init__(self):
        self.calls = []

    def prefers(self, device):
        return False  # never picked by the fixed order: only through the cache

    def fn(self, x, w, offs, table=None):
        self.calls.append(1)
        return moe.grouped_mm_loop(x, w, offs)


def test_grouped_mm_dispatch_follows_the_recorded_backend(cache, monkeypatch):
    """A recorded choice replaces "auto" per shape (even a backend auto never picks), is remembered for the run
    record, and never beats a named one."""
    x, w = torch.randn(10, 4), torch.randn(3, 4, 5)
    offs = torch.tensor([3, 7, 10], dtype=torch.int32)
    spy = _Spy()
    saved = dict(moe.REGISTRY._backends)
    moe.REGISTRY.register(spy)
    try:
        cpu = torch.device("cpu")
        torch.testing.assert_close(moe.grouped_mm(x, w, offs), moe.grouped_mm_loop(x, w, offs))
        assert not spy.calls
        tuned.record("moe.grouped_mm", tuned.grouped_mm_key(x, w), "spy", {}, {}, cpu)
        torch.testing.assert_close(moe.grouped_mm(x, w, offs), moe.grouped_mm_loop(x, w, offs))
        assert spy.calls == [1]
        assert tuned.hits()[f"moe.grouped_mm|{tuned.grouped_mm_key(x, w)}"] == "spy"
        moe.grouped_mm(x, w, offs, backend="reference")  # an explicit choice still wins
        assert spy.calls == [1]
    finally:
        moe.REGISTRY._backends.clear()
        moe.REGISTRY._backends.update(saved)
