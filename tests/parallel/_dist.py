"""Run one function on N gloo ranks (CPU), each in a fresh Python process, and return every rank's result.

Why subprocesses and not torch.multiprocessing: pytest imports test files with --import-mode=importlib, so a
spawned child cannot import a test module by name. Each child here runs this file as a script, loads the test
file by path, initialises gloo through a FileStore (no port races between tests running side by side), calls
`fn(rank, world_size, **kwargs)` and saves its return value with torch.save.

    results = run_ranks(__file__, "_worker", world_size=2, steps=3)   # [result of rank 0, result of rank 1]
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_THIS = Path(__file__).resolve()
_REPO = _THIS.parents[2]


def run_ranks(file: str, fn_name: str, world_size: int, timeout: float = 120.0, **kwargs) -> list:
    """Run `fn_name` from `file` on `world_size` gloo ranks; returns the per-rank return values (rank order).

    kwargs must pickle. A failing rank raises RuntimeError carrying that rank's stderr tail; a hang past
    `timeout` seconds kills every rank and raises TimeoutError.
    """
    with tempfile.TemporaryDirectory(prefix="moestack_dist_") as tmp:
        tmp = Path(tmp)
        (tmp / "job.pkl").write_bytes(pickle.dumps({"file": str(Path(file).resolve()), "fn": fn_name,
                                                   "world_size": world_size, "kwargs": kwargs}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO)}
        procs, logs = [], []
        for rank in range(world_size):
            log = open(tmp / f"rank{rank}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, str(_THIS), str(tmp), str(rank)], env=env, cwd=_REPO,
                                          stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            timed_out = any(p.poll() is None for p in procs)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for rank, (p, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            text = log.read()
            log.close()
            if p.returncode != 0 and not (timed_out and p.returncode == -9):
                raise RuntimeError(f"rank {rank} of {world_size} failed (exit {p.returncode}):\n{text[-6000:]}")
        if timed_out:
            raise TimeoutError(f"{fn_name} on {world_size} ranks did not finish within {timeout} s")
        import torch

        return [torch.load(tmp / f"result{r}.pt", weights_only=False) for r in range(world_size)]


def _child(tmp: Path, rank: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    job = pickle.loads((tmp / "job.pkl").read_bytes())
    world_size = job["world_size"]
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=world_size)
    spec = importlib.util.spec_from_file_location(f"_dist_job_{Path(job['file']).stem}", job["file"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        result = getattr(module, job["fn"])(rank, world_size, **job["kwargs"])
        torch.save(result, tmp / f"result{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _child(Path(sys.argv[1]), int(sys.argv[2]))


def small_model_spec():
    """The tiny preset shrunk further for multi-rank CPU tests: same layer kinds (KDA x3 + gated DSA, dense first
    layer, Stable LatentMoE with a shared expert), 8 experts top-2, ~0.2M parameters."""
    from moestack.config.model_spec import ModelSpec, load_model_spec

    d = load_model_spec("tiny").model_dump()
    d.update(name="tiny-mp", hidden_size=64, max_seq_len=64)
    d["kda"].update(num_heads=2, head_dim=16, gate_rank=16, chunk_size=8)
    d["mla"].update(num_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=8, indexer={"num_heads": 2, "head_dim": 16, "top_k": 8})
    d["moe"].update(num_experts=8, top_k=2, expert_intermediate_size=32, latent_size=32, num_shared_experts=1,
                    shared_intermediate_size=64)
    d["moe"]["router"].update(seq_aux_loss_coef=1e-2)
    d["dense_mlp"] = {"intermediate_size": 128}
    return ModelSpec.model_validate(d)
