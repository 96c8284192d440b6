"""Fixtures shared by the op tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def nan_poisoned_outputs(monkeypatch):
    """Every float tensor torch.empty* allocates starts as NaN (int ones as -7), so unwritten elements fail.
    A test file opts in with `pytestmark = pytest.mark.usefixtures("nan_poisoned_outputs")`."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
