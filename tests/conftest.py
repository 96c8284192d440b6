import os
import shutil

# Without a GPU, every Triton kernel in the suite runs in the interpreter. The switch must be set before the first
# moestack module that defines a kernel is imported (the decorator reads it), and collection imports model code
# long before the Triton test files run: one session-wide setting keeps the order of test files irrelevant.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Keep CPU tests predictable on the 2-core CI machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_addoption(parser):
    parser.addoption("--fresh-ranks", action="store_true",
                     help="multi-process tests start fresh rank processes for every job (no rank pool)")


def pytest_configure(config):
    if config.getoption("--fresh-ranks"):
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent / "parallel"))
        import _dist  # the module the parallel tests import (same sys.modules entry)

        _dist.FRESH_RANKS[0] = True


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
