"""Fixtures shared by the memory-policy tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from moestack.config.model_spec import ModelSpec, load_model_spec


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny ops: one intra-op thread is faster than two on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def small_spec() -> ModelSpec:
    """The tiny preset cut to two blocks that hold every part kind: (KDA, dense MLP) and (gated DSA, LatentMoE),
    with a sequence aux loss large enough that its gradients matter."""
    data = load_model_spec("tiny").model_dump()
    data.update(num_layers=2, full_attention_layers=[2], dense_layers=[1])
    data["moe"]["router"]["seq_aux_loss_coef"] = 0.05
    return ModelSpec.model_validate(data)


@pytest.fixture(scope="session")
def bench():
    """benchmarks/memory.py as a module (its plans, technique table and planner prediction)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "memory.py"
    spec = importlib.util.spec_from_file_location("memory_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def cpu_mesh(tmp_path):
    """A one-rank gloo process group and its CPU device mesh (DTensor parameters as FSDP2 shards them)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
