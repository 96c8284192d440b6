import os

import pytest
import torch

# Keep CPU tests predictable on the 2-core CI machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
