"""The rank pool (_dist.py) hands every job the process state of a fresh rank: a job that changes process-global
state (a rebound module constant, the aux-loss scale, torch's default dtype and threads, the RNGs, an
environment variable, a replaced backend registration) is followed by one that sees none of it, in the same rank
processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _dist  # noqa: E402
from _dist import run_ranks  # noqa: E402

LEAK_ENV = "TEST_DIST_LEAK_PROBE"


def _probe(rank: int, world: int) -> dict:
    """What a job sees (and the RNG's next draws); imports the moestack modules it reads."""
    import os
    import random

    from moestack.model import aux_loss
    from moestack.ops import moe as moe_ops
    from moestack.ops.fp8 import reference as fp8_ref

    return {"pid": os.getpid(), "fp8": fp8_ref.FP8, "aux_scale": list(aux_loss._SCALE),
            "dtype": torch.get_default_dtype(), "threads": torch.get_num_threads(), "grad": torch.is_grad_enabled(),
            "env": os.environ.get(LEAK_ENV), "torch_rng": torch.rand(3), "py_rng": random.random(),
            "backend": (moe_ops.REGISTRY.names(), moe_ops.REGISTRY.get("reference").unavailable(torch.device("cpu"))),
            "restored": list(sys.modules["__main__"].RESTORED)}


def _mutate(rank: int, world: int) -> int:
    """Change all of it, as a careless test would, and leave it changed."""
    import os
    import random

    from moestack.model import aux_loss
    from moestack.ops import moe as moe_ops
    from moestack.ops.backends import Backend
    from moestack.ops.fp8 import reference as fp8_ref

    class Broken(Backend):
        name = "reference"

        def unavailable(self, device):
            return "replaced by a careless test"

    fp8_ref.FP8 = torch.float32
    aux_loss.set_aux_loss_scale(0.25)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    torch.manual_seed(1234)
    random.seed(1234)
    os.environ[LEAK_ENV] = "leaked"
    moe_ops.REGISTRY.register(Broken(), first=True)
    return os.getpid()


def test_jobs_do_not_leak_process_state():
    if _dist.FRESH_RANKS[0]:
        pytest.skip("--fresh-ranks: no rank pool whose state could leak")
    pool = _dist._POOLS.pop(2, None)  # a fresh pool: the first probe sees a fresh process's state
    if pool is not None:
        pool.close()
    first = run_ranks(__file__, "_probe", world_size=2)
    mutated = run_ranks(__file__, "_mutate", world_size=2)
    after = run_ranks(__file__, "_probe", world_size=2)
    for rank in range(2):
        a, b = first[rank], after[rank]
        assert a["pid"] == mutated[rank] == b["pid"], "the jobs must run in the same (pooled) rank processes"
        assert a["fp8"] == torch.float8_e4m3fn and a["aux_scale"] == [1.0] and a["dtype"] == torch.float32
        for key in ("fp8", "aux_scale", "dtype", "threads", "grad", "env", "py_rng", "backend"):
            assert a[key] == b[key], f"rank {rank}: {key} leaked from the previous job: {a[key]} -> {b[key]}"
        assert torch.equal(a["torch_rng"], b["torch_rng"]), f"rank {rank}: the torch RNG did not start afresh"
        # the guard saw (and put back) each change
        for what in ("fp8.reference.FP8", "aux_loss._SCALE (contents)", "torch default dtype", "torch threads",
                     "torch grad mode", "moestack.ops.moe.REGISTRY (backends)"):
            assert any(r.endswith(what) for r in b["restored"]), (rank, what, b["restored"])
