"""Fixtures shared by the multi-rank tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """A test's single-process reference run on one intra-op thread, as the ranks run (OMP_NUM_THREADS=1): on a busy
    2-core machine two threads made each step of the tiny models take seconds instead of ~0.1 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
