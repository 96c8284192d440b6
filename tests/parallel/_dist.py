"""Run one function on N gloo ranks (CPU) and return every rank's result.

    results = run_ranks(__file__, "_worker", world_size=2, steps=3)   # [result of rank 0, result of rank 1]

Why subprocesses and not torch.multiprocessing: pytest imports test files with --import-mode=importlib, so a
spawned child cannot import a test module by name. Each rank here is a Python process running this file as a
script; it joins a gloo group through a FileStore (no port races with tests running side by side), then serves
jobs: load the test file by path, call `fn(rank, world_size, **kwargs)`, torch.save the return value.

The ranks of one world size are kept as a pool between jobs that follow each other closely (within IDLE_S):
importing torch, FSDP and dynamo costs several CPU-seconds per process, more than many jobs, on a 2-core CI
machine. An idle pool is retired (every gloo group keeps a thread that polls, so idle ranks are not free). A job
that fails or hangs on any rank takes the pool down (the next job starts a fresh one) and raises with that rank's
traceback. Jobs share the process group (do not destroy groups: DTensor caches sharding decisions per mesh layout,
and equal meshes of a later job may resolve to earlier groups) and the loaded modules. Process-global state a job
changes is put back after it (`ProcessState`): os.environ, the cwd, torch's default dtype, intra-op threads,
grad mode and deterministic-algorithm flags, the torch / random / numpy RNGs (every job starts with a fresh
process's), and the module-level values of every moestack module as they were when it finished importing (a
rebound name such as `reference.FP8 = torch.float32`, a changed list, a dict entry replaced or removed, a backend
registry's backends (moestack/ops/backends.py) replaced, removed or reordered; entries a job adds to a dict or set
stay: lazy backend registrations and caches). What was put back is printed to the rank's
log and kept in RESTORED (tests/parallel/test_dist_state.py checks all of it).
`pytest --fresh-ranks` starts fresh processes for every job instead (FRESH_RANKS, set by tests/conftest.py).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import pickle
import select
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

_THIS = Path(__file__).resolve()
_REPO = _THIS.parents[2]
FRESH_RANKS = [False]  # pytest --fresh-ranks (tests/conftest.py)
IDLE_S = 15.0  # a pool idle longer than this is replaced; its ranks exit on their own after IDLE_S + 5 s


class _Pool:
    """world_size rank processes with an initialised gloo group, fed job directories on their stdin."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.tmp = tempfile.TemporaryDirectory(prefix="moestack_dist_")
        root = Path(self.tmp.name)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO)}
        self.logs = [open(root / f"rank{r}.log", "w+") for r in range(world_size)]
        self.procs = [subprocess.Popen([sys.executable, str(_THIS), str(root), str(r), str(world_size)], env=env,
                                       cwd=_REPO, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                       text=True)
                      for r, log in enumerate(self.logs)]
        self.jobs = 0
        self.last_used = time.monotonic()

    def usable(self) -> bool:
        return time.monotonic() - self.last_used < IDLE_S and all(p.poll() is None for p in self.procs)

    def log_tail(self, rank: int) -> str:
        self.logs[rank].flush()
        self.logs[rank].seek(0)
        return self.logs[rank].read()[-4000:]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in self.logs:
            log.close()
        self.tmp.cleanup()

    def run(self, job: dict, timeout: float) -> list:
        import torch

        self.jobs += 1
        job_dir = Path(self.tmp.name) / f"job{self.jobs}"
        job_dir.mkdir()
        (job_dir / "job.pkl").write_bytes(pickle.dumps(job))
        for p in self.procs:
            p.stdin.write(f"{job_dir}\n")
            p.stdin.flush()
        deadline = time.monotonic() + timeout
        while not all((job_dir / f"done{r}").exists() for r in range(self.world_size)):
            errors = sorted(job_dir.glob("error*.txt"))
            if errors:
                rank = int(errors[0].stem.removeprefix("error"))
                raise RuntimeError(f"{job['fn']}: rank {rank} of {self.world_size} failed:\n"
                                   f"{errors[0].read_text()[-6000:]}")
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{job['fn']}: rank {dead[0]} of {self.world_size} died (exit "
                                   f"{self.procs[dead[0]].returncode}):\n{self.log_tail(dead[0])}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job['fn']} on {self.world_size} ranks did not finish within {timeout} s")
            time.sleep(0.02)
        errors = sorted(job_dir.glob("error*.txt"))
        if errors:  # every rank failed (and still marked itself done)
            raise RuntimeError(f"{job['fn']}: rank {errors[0].stem.removeprefix('error')} of {self.world_size} "
                               f"failed:\n{errors[0].read_text()[-6000:]}")
        self.last_used = time.monotonic()
        return [torch.load(job_dir / f"result{r}.pt", weights_only=False) for r in range(self.world_size)]


_POOLS: dict[int, _Pool] = {}
SESSION_CACHE: dict = {}  # pytest-process memo for results several test files share (they import _dist by name)


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def run_ranks(file: str, fn_name: str, world_size: int, timeout: float = 120.0, **kwargs) -> list:
    """Run `fn_name` from `file` on `world_size` gloo ranks; returns the per-rank return values (rank order).

    kwargs must pickle. The current os.environ is applied on every rank for the job. A failing rank raises
    RuntimeError with its traceback; a hang past `timeout` seconds raises TimeoutError. Either way the ranks are
    killed (no rank is left waiting in a collective).
    """
    job = {"file": str(Path(file).resolve()), "fn": fn_name, "kwargs": kwargs, "env": dict(os.environ)}
    pool = _POOLS.get(world_size)
    if pool is None or not pool.usable() or FRESH_RANKS[0]:
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(job, timeout)
    except BaseException:
        pool.close()
        del _POOLS[world_size]
        raise


_MISSING = object()
RESTORED: list[str] = []  # in a rank process: what ProcessState put back after the last job


class ProcessState:
    """Snapshots of the process-global state a job may change, and `job()`, which puts them back afterwards.

    moestack modules are snapshotted when they finish importing (`install` adds an import hook), so a module a job
    imports for the first time is protected from that job's own changes too.
    """

    def __init__(self):
        import torch

        self.modules: dict[str, tuple[object, dict]] = {}
        self.registries: dict[int, tuple[str, object, dict, dict]] = {}  # id -> (where, registry, its dict, copy)
        self.cwd = os.getcwd()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.rng = self._rng_state()

    @staticmethod
    def _rng_state() -> tuple:
        import random

        import torch

        np = sys.modules.get("numpy")
        return torch.get_rng_state(), random.getstate(), np.random.get_state() if np is not None else None

    def snapshot_module(self, module) -> None:
        """Every global of `module` by reference, and a shallow copy of each list, dict and set."""
        values = {name: (v, list(v) if type(v) is list else dict(v) if type(v) is dict else set(v)
                         if type(v) is set else None)
                  for name, v in vars(module).items() if not (name.startswith("__") and name.endswith("__"))}
        self.modules[module.__name__] = (module, values)
        for name, v in vars(module).items():  # backend registries (objects, so the copies above miss them)
            for key, reg in (v.items() if type(v) is dict else [(None, v)]):
                if _is_registry(reg) and id(reg) not in self.registries:
                    where = f"{module.__name__}.{name}" + (f"[{key!r}]" if key is not None else "")
                    self.registries[id(reg)] = (where, reg, reg._backends, dict(reg._backends))

    def install(self) -> None:
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] == "moestack" and module is not None:
                self.snapshot_module(module)
        sys.meta_path.insert(0, _SnapshotOnImport(self))

    def restore(self) -> list[str]:
        """Put everything back; returns what had changed ("module.name", "torch default dtype", ...)."""
        import random

        import torch

        changed = []
        for mod_name, (module, values) in self.modules.items():
            namespace = vars(module)
            for name, (ref, content) in values.items():
                if namespace.get(name, _MISSING) is not ref:
                    namespace[name] = ref
                    changed.append(f"{mod_name}.{name}")
                if content is not None and _restore_content(ref, content):
                    changed.append(f"{mod_name}.{name} (contents)")
        for where, reg, backends, content in self.registries.values():
            if reg._backends is not backends or list(backends.items()) != list(content.items()):
                backends.clear()
                backends.update(content)
                reg._backends = backends
                changed.append(f"{where} (backends)")
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
            changed.append("cwd")
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
            changed.append("torch default dtype")
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
            changed.append("torch threads")
        if (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
            changed.append("torch deterministic algorithms")
        if not torch.is_grad_enabled():
            torch.set_grad_enabled(True)
            changed.append("torch grad mode")
        torch_rng, py_rng, np_rng = self.rng  # always reset (compared, it would cost as much)
        torch.set_rng_state(torch_rng)
        random.setstate(py_rng)
        if np_rng is not None:
            sys.modules["numpy"].random.set_state(np_rng)
        elif "numpy" in sys.modules:  # first imported by a job: keep its fresh state from now on
            self.rng = (torch_rng, py_rng, sys.modules["numpy"].random.get_state())
        return changed

    @contextlib.contextmanager
    def job(self, env: dict[str, str]):
        """os.environ := env for the job; afterwards the environment and everything else as before."""
        saved_env = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
            RESTORED[:] = self.restore()
            if RESTORED:
                print(f"[_dist] restored after the job: {', '.join(RESTORED)}", flush=True)


def _is_registry(v) -> bool:
    return type(v).__name__ == "Registry" and type(v).__module__ == "moestack.ops.backends"


def _restore_content(ref, content) -> bool:
    """Put a list's items, a dict's replaced / removed entries, a set's removed items back; True if any."""
    if type(ref) is list:
        if len(ref) != len(content) or any(a is not b for a, b in zip(ref, content)):
            ref[:] = content
            return True
        return False
    if type(ref) is dict:
        bad = {k: v for k, v in content.items() if ref.get(k, _MISSING) is not v}
        ref.update(bad)
        return bool(bad)
    if type(ref) is set:
        lost = content - ref
        ref |= lost
        return bool(lost)
    return False


class _SnapshotOnImport(importlib.abc.MetaPathFinder):
    """Finds moestack modules as the path finder would, and snapshots each one right after it executes."""

    def __init__(self, state: ProcessState):
        self.state = state

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] != "moestack":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, state = spec.loader.exec_module, self.state

        def exec_and_snapshot(module):
            exec_module(module)
            state.snapshot_module(module)

        spec.loader.exec_module = exec_and_snapshot  # (a loader object per spec: only this module's)
        return spec


def _serve(root: Path, rank: int, world_size: int) -> None:
    """A rank process: join the group, then run the jobs named on stdin until it closes."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    # One gloo device (one tcp loop thread) for every group: each device's loop thread wakes ~100 times a second,
    # and jobs never destroy groups, so per-group devices made idle ranks burn ~0.2% of a core per group.
    import torch.distributed.distributed_c10d as c10d

    base, device = c10d.ProcessGroupGloo, c10d.ProcessGroupGloo.create_default_device()

    class _SharedDeviceGloo(base):
        def __init__(self, store, rank, size, timeout=None):
            options = base._Options()
            options._devices = [device]
            if timeout is not None:
                options._timeout = timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = _SharedDeviceGloo
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=world_size)
    modules: dict[str, object] = {}
    base_env = dict(os.environ)
    state = ProcessState()
    state.install()
    while select.select([sys.stdin], [], [], IDLE_S + 5.0)[0] and (line := sys.stdin.readline()):
        job_dir = Path(line.strip())
        job = pickle.loads((job_dir / "job.pkl").read_bytes())
        env = {**job["env"], **{k: base_env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                         "OMP_NUM_THREADS")}}
        try:
            with state.job(env):
                if job["file"] not in modules:
                    spec = importlib.util.spec_from_file_location(f"_dist_job_{Path(job['file']).stem}",
                                                                  job["file"])
                    module = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(module)
                    modules[job["file"]] = module
                result = getattr(modules[job["file"]], job["fn"])(rank, world_size, **job["kwargs"])
            torch.save(result, job_dir / f"result{rank}.pt")
        except BaseException:
            (job_dir / f"error{rank}.txt").write_text(traceback.format_exc())
            raise
        finally:
            (job_dir / f"done{rank}").touch()
            sys.stdout.flush()


if __name__ == "__main__":
    _serve(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))


def small_model_spec(seq_aux_loss_coef: float = 1e-2):
    """The tiny preset shrunk further for multi-rank CPU tests: same layer kinds (KDA x3 + gated DSA, dense first
    layer, Stable LatentMoE with a shared expert), 8 experts top-2, ~0.26M parameters."""
    from moestack.config.model_spec import ModelSpec, load_model_spec

    d = load_model_spec("tiny").model_dump()
    d.update(name="tiny-mp", hidden_size=64, max_seq_len=64)
    d["kda"].update(num_heads=2, head_dim=16, gate_rank=16, chunk_size=8)
    d["mla"].update(num_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=8, indexer={"num_heads": 2, "head_dim": 16, "top_k": 8})
    d["moe"].update(num_experts=8, top_k=2, expert_intermediate_size=32, latent_size=32, num_shared_experts=1,
                    shared_intermediate_size=64)
    d["moe"]["router"].update(seq_aux_loss_coef=seq_aux_loss_coef)
    d["dense_mlp"] = {"intermediate_size": 128}
    return ModelSpec.model_validate(d)


# Layer 0's pre-mixer Attention-Residual mix has one source (the embedding): its weights get an exact zero gradient
# (as in K3), so gradient checks that insist on non-zero gradients exempt them.
ATTN_RES_ZERO_GRAD = ("layers.0.attn_res.norm_weight", "layers.0.attn_res.proj_weight")


def randomise_attn_res(model, seed: int = 5) -> None:
    """Give the Attention-Residual pseudo-queries of a freshly built model random values (the same on every rank):
    their zero init makes every mix a plain mean and the norm-weight factors' gradients zero."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res." in name:
                value = torch.randn(p.shape, generator=g, dtype=torch.float64)
                p.copy_(1.0 + 0.1 * value if name.endswith("norm_weight") else 0.3 * value)
