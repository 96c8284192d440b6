"""`moestack train --plan plan.yaml --dry-run [--rank R] [--no-step]`: launch a plan at its full world size on a CPU.

One process plays rank R of plan.devices ranks on torch's fake process group (every collective returns at once and
moves nothing). The trainer builds this rank's part exactly as a real launch does (`Trainer(..., dry_run=True)`:
the same meshes, pipeline split, `parallelize`, meta-device build), then the dry run
  1. checks the meta-device initialisation (`moestack.parallel.init`): every tensor is initialised and every
     DTensor shard's global indices match its local shape,
  2. materialises the part as fake tensors (torch FakeTensorMode: shapes and dtypes, no memory) and counts
     parameters, gradients (one per trainable parameter) and the optimizer's state after one `optimizer.step()`
     of the trainer's own optimizer on fake gradients (an optimizer that refuses the plan fails here),
  3. unless --no-step: runs one micro-batch forward + backward through each stage this rank holds, twice (gradient
     sync off, as inside the accumulation, then on, as the step's last micro-batch; under zbv / dualpipev, whose
     stage is the FSDP root, the first micro-batch, which gathers, then a later one), then the step's end (the
     schedule's REDUCE_GRAD, deferred TP sums, clipping, router-bias counts, the optimizer), recording every
     collective at the dispatcher level (kind, process group, bytes), scaled to the step's m micro-batches; under
     pp > 1 the schedule's own send / receive list for this rank adds the pipeline p2p,
  4. reports all of it next to the planner's prediction for this rank's pipeline stage (moestack/planner/cost/).
Assumptions: routing is balanced (no token values: every EP rank receives as many rows as it sends); KDA runs a
shape-only stand-in (moestack/ops/kda: no values, and it issues no collectives); the FP8 recipe
is not applied (its kernels need an FP8 GPU; the layout is the bf16 one); a GPU cluster's plan is built with bf16
compute (FSDP gathers in bf16) as on the GPU. The pipeline stages run outside the schedule (one micro-batch each;
the schedule's UNSHARD / RESHARD / REDUCE_GRAD actions are the stage module's own FSDP hooks here).
Anything the runtime refuses (a plan field it cannot honour, a layout that does not divide, an optimizer refusing
offload) is a ConfigError, one line, as in a real launch.
A process plays one rank: DTensor caches sharding decisions with the meshes (coordinates included) they were made
on, so a dry run of another rank in the same process would see the first one's; `run_isolated` spawns a process.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from moestack.config.base import ConfigError
from moestack.config.model_spec import ModelSpec
from moestack.config.plan import V_SHAPE, Plan
from moestack.config.train_spec import TrainSpec
from moestack.memory.phase_peaks import GIB
from moestack.model.init import init_model
from moestack.parallel.comm import global_grad_norm
from moestack.parallel.fsdp import set_gradient_sync
from moestack.parallel.init import global_indices
from moestack.parallel.tensor import finish_tp_grad_reduce

MIB = 2**20
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"}


@dataclass
class Traffic:
    calls: float = 0.0
    bytes: float = 0.0

    def add(self, other: Traffic, times: float = 1.0) -> None:
        self.calls += other.calls * times
        self.bytes += other.bytes * times


@dataclass
class DryRunReport:
    plan: Plan
    rank: int
    coords: dict[str, int]  # this rank's index on every mesh dim
    stages: dict[int, list[int]]  # pipeline stage -> its layers (this rank's stages)
    params: dict[str, float]  # bytes of this rank's parameter shards: dense / experts
    param_count: dict[str, int]
    gathered_bytes: float  # the largest FSDP unit gathered for compute (all of a stage when the stage is the root)
    grads: float  # bytes
    optimizer: float  # bytes of optimizer state (host memory under offload.optimizer)
    planner_memory: dict[str, float]  # bytes, the planner's components for this rank's pipeline stage
    planner_time: dict[str, float]  # seconds per step
    collectives: dict[tuple[str, str], Traffic] = field(default_factory=dict)  # (kind, group) -> per step
    notes: list[str] = field(default_factory=list)
    wall_s: dict[str, float] = field(default_factory=dict)

    def lines(self) -> list[str]:
        p = self.plan
        big = max(self.params["dense"] + self.params["experts"], self.gathered_bytes, self.grads) >= GIB
        unit, scale = ("GiB", GIB) if big else ("MiB", MIB)

        def gib(b: float) -> str:
            return f"{b / scale:.2f}"

        coords = " ".join(f"{k}{v}" for k, v in self.coords.items())
        out = [f"dry run: rank {self.rank} of {p.devices} ({coords}) | plan {p.short()} {p.schedule} | "
               f"{p.num_microbatches} micro-batches of {p.micro_batch_size} x {p.seq_len}"]
        out.append("stages held: " + "; ".join(f"stage {s}: layers {_ranges(ls)}" for s, ls in self.stages.items()))
        pm = self.planner_memory
        rows = [("parameters (this rank's shards)", self.params["dense"] + self.params["experts"], pm.get("weights")),
                ("  of which routed experts", self.params["experts"], None),
                ("gathered for compute (largest unit; all of a V stage)", self.gathered_bytes, None),
                ("gradients" + (" (unsharded all step)" if p.schedule in V_SHAPE and p.zero_stage else ""),
                 self.grads, pm.get("gradients")),
                ("optimizer state" + (" (host)" if p.offload.optimizer else ""), self.optimizer,
                 pm.get("host") if p.offload.optimizer else pm.get("optimizer")),
                ("activations (planner: expected)", None, pm.get("activations")),
                ("buffers / reserved (planner)", None, pm.get("buffers", 0.0) + pm.get("reserved", 0.0)
                 if pm else None)]
        out.append(f"{'memory, ' + unit + ' per device':<52} {'runtime':>10} {'planner':>10}")
        for name, runtime, planned in rows:
            out.append(f"{name:<52} {'-' if runtime is None else gib(runtime):>10} "
                       f"{'-' if planned is None else gib(planned):>10}")
        out.append(f"  (parameters: {self.param_count['dense']:,} dense + {self.param_count['experts']:,} expert "
                   "elements; the planner's weights include the gathered / bf16 copies it expects)")
        if self.collectives:
            out.append(f"{'collectives per step (group(size))':<52} {'calls':>10} {unit:>10}")
            totals: dict[str, Traffic] = defaultdict(Traffic)
            for (kind, group), t in sorted(self.collectives.items(), key=lambda kv: -kv[1].bytes):
                out.append(f"  {kind + ' over ' + group:<50} {t.calls:>10,.0f} {t.bytes / scale:>10.2f}")
                totals[group].add(t)
            out.append("  per group: " + ", ".join(f"{g} {t.bytes / scale:.2f} {unit}" for g, t in
                                                    sorted(totals.items(), key=lambda kv: -kv[1].bytes)))
            comm = {k: v for k, v in self.planner_time.items() if k.endswith(("comm", "p2p", "sum"))}
            out.append("planner, exposed communication s/step: " +
                       (", ".join(f"{k} {v:.3f}" for k, v in comm.items()) or "none"))
        out += [f"note: {n}" for n in self.notes]
        out.append("wall: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.wall_s.items()))
        return out


def _ranges(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0]) if ids else "-"


class _CollectiveRecorder(TorchDispatchMode):
    """Counts every c10d / functional collective this process issues: (kind, group label) -> calls, bytes. Bytes
    are the larger of the op's input and output buffers (an all-gather's output, a reduce-scatter's input)."""

    def __init__(self, labels: dict[str, str]):
        super().__init__()
        self.labels = labels
        self.traffic: dict[tuple[str, str], Traffic] = defaultdict(Traffic)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns in COLLECTIVE_NAMESPACES and name not in NOT_COLLECTIVES and not self.skip(args, kwargs):
            t = self.traffic[(name.rstrip("_").removeprefix("_"), self._group(args, kwargs))]
            t.calls += 1
            t.bytes += max([_nbytes(a) for a in (*args, *kwargs.values())] + [_nbytes(out)])
        return out

    def _group(self, args, kwargs) -> str:
        for a in (*args, *kwargs.values()):
            name = a if isinstance(a, str) else getattr(a, "group_name", None)
            if isinstance(a, torch.ScriptObject):
                try:
                    name = dist.ProcessGroup.unbox(a).group_name
                except (RuntimeError, AttributeError):
                    name = None
            if name in self.labels:
                return self.labels[name]
        return "?"

    def skip(self, args, kwargs) -> bool:
        return self._group(args, kwargs).endswith("(1)")  # a group of one rank moves nothing


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _group_labels(meshes) -> dict[str, str]:
    """group_name -> the mesh dims (or flattened dims) it serves, e.g. "dp_shard/ep(8)", for this rank's groups."""
    names: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for mesh in (meshes.dense, meshes.experts, meshes.hier):
        if mesh is None:
            continue
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        dims = list(mesh.mesh_dim_names or ())
        flat = getattr(root, "_flatten_mapping", {}) or {}
        for dim in [*dims, *flat]:
            try:
                group = (mesh[dim] if dim in dims else flat[dim]).get_group()
            except (KeyError, RuntimeError, ValueError):
                continue
            if dim not in names.setdefault(group.group_name, []):
                names[group.group_name].append(dim)
            sizes[group.group_name] = dist.get_world_size(group)
    world = dist.group.WORLD.group_name
    names.setdefault(world, ["world"])
    sizes.setdefault(world, dist.get_world_size())
    return {g: f"{'/'.join(dims)}({sizes[g]})" for g, dims in names.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _check_init(whole: torch.nn.Module, seed: int) -> None:
    """The meta path of moestack.parallel.init on this rank without drawing: every tensor initialised, every
    DTensor shard's global indices consistent with its local shape."""

    def locate(t: torch.Tensor):
        if isinstance(t, DTensor) and t.device_mesh.get_coordinate() is not None:
            index = global_indices(t.shape, t.device_mesh, t.placements)
            got = tuple(t.shape[d] if i is None else i.numel() for d, i in enumerate(index))
            if got != tuple(t._local_tensor.shape):
                raise ConfigError(f"meta init: shard indices {got} do not match the local shape "
                                  f"{tuple(t._local_tensor.shape)} ({tuple(t.shape)}, {t.placements})")
        return None

    init_model(whole, seed, "cpu", locate=locate)


def _gathered_bytes(model: torch.nn.Module, param_dtype_bytes: int, held: bool) -> float:
    """Bytes of the largest FSDP unit gathered for compute (the whole stage when it stays gathered all step)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    sizes = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in fully_shard.state(module)._fsdp_param_groups:  # local shard x shard group = unsharded
            n = sum(fp.padded_sharded_param_size.numel() * fp.mesh_info.shard_mesh_size for fp in group.fsdp_params)
            sizes.append(n * param_dtype_bytes)
    if not sizes:
        return 0.0
    return float(sum(sizes) if held else max(sizes))


def _planner(plan: Plan) -> tuple[dict[str, float], dict[str, float], list[dict[str, float]]]:
    from moestack.planner.search import load_problem

    pb = load_problem(plan.model, plan.cluster, plan.devices, plan.seq_len, None, None, plan.precision,
                      plan.optimizer)
    cost = pb.cost.evaluate(plan)
    return cost.memory | {"host": cost.host_bytes}, cost.time, cost.memory_by_pp_rank


def _p2p_per_step(runner, plan: Plan, pp_rank: int, hidden_bytes: int) -> Traffic:
    """Pipeline sends + receives of this rank in one step, from the schedule's own action list."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    order = getattr(runner.schedule, "pipeline_order_with_comms", None)
    t = Traffic()
    if order is not None:
        for action in order[pp_rank]:
            if action.computation_type in (C.SEND_F, C.RECV_F, C.SEND_B, C.RECV_B):
                t.calls += 1
                t.bytes += hidden_bytes
        return t
    m, first, last = plan.num_microbatches, pp_rank == 0, pp_rank == plan.pp - 1
    t.calls = m * (2 * (not first) + 2 * (not last))  # 1f1b / gpipe: per micro-batch, recv + send each way
    t.bytes = t.calls * hidden_bytes
    return t


def dry_run(plan: Plan, spec: TrainSpec, model_spec: ModelSpec, rank: int = 0, step: bool = True) -> DryRunReport:
    """Rank `rank`'s part of `plan`, built by the trainer on a fake process group of plan.devices ranks (module
    docstring). Must run in a process without an initialised process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moestack.config.cluster import load_cluster_spec
    from moestack.train.trainer import Trainer

    if not 0 <= rank < plan.devices:
        raise ConfigError(f"--rank: {rank} is not a rank of the plan's {plan.devices} devices (0..{plan.devices - 1})")
    if dist.is_initialized():
        raise ConfigError("--dry-run: run it in a plain process, not under torchrun (it plays one rank itself)")
    wall: dict[str, float] = {}
    t0 = time.perf_counter()
    notes = []
    build_plan = plan
    if plan.precision == "fp8":
        build_plan = plan.model_copy(update={"precision": "bf16"})
        notes.append("precision fp8: the FP8 recipe is not applied (its kernels need an FP8 GPU); bf16 layout")
    gpu = load_cluster_spec(plan.cluster).device.name != "cpu"
    update = {"device": "cpu"}
    if gpu and spec.precision == "auto":
        update["precision"] = "bf16"  # as on the GPU: bf16 compute, FSDP gathers in bf16
    spec = spec.model_copy(update=update)
    global _PLAYED
    if _PLAYED is not None and _PLAYED != (rank, plan.devices):
        raise ConfigError(f"--dry-run: this process already played rank {_PLAYED[0]} of {_PLAYED[1]}; DTensor keeps "
                          "that run's meshes in its caches, so another rank needs a fresh process (run_isolated)")
    _PLAYED = (rank, plan.devices)
    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.devices)
    try:
        trainer = Trainer(spec, model_spec, log=lambda *a, **k: None, plan=build_plan, dry_run=True)
        wall["build"] = time.perf_counter() - t0
        return _measure(trainer, plan, step, notes, wall)
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()


_PLAYED: tuple[int, int] | None = None  # (rank, world size) a dry run of this process played


def _isolated(queue, args) -> None:
    try:
        queue.put(dry_run(*args))
    except BaseException as err:  # noqa: BLE001 - re-raised in the caller
        queue.put(err)


def run_isolated(plan: Plan, spec: TrainSpec, model_spec: ModelSpec, rank: int = 0, step: bool = True
                 ) -> DryRunReport:
    """`dry_run` in a fresh (spawned) process: any number of ranks from one caller (tests, scripts)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_isolated, args=(queue, (plan, spec, model_spec, rank, step)))
    proc.start()
    result = queue.get()
    proc.join()
    if isinstance(result, BaseException):
        raise result
    return result


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions by op schema, whose equal meshes of an earlier run (another rank, in
    this process) would hand out that run's mesh object, coordinates included: a second dry run must not see them."""
    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    type(prop)._propagate_tensor_meta_cached.cache_clear()


def _measure(trainer, plan: Plan, step: bool, notes: list[str], wall: dict[str, float]) -> DryRunReport:
    from moestack.parallel.pipeline import split_stages, stage_costs, stage_ids_for_rank
    from moestack.train.trainer import uses_bf16

    spec, meshes, model = trainer.spec, trainer.dist.meshes, trainer.model
    t = time.perf_counter()
    _check_init(trainer.whole_model, spec.seed)
    wall["init check"] = time.perf_counter() - t
    dense = meshes.dense
    coords = {d: dense.get_local_rank(d) for d in dense.mesh_dim_names}
    coords |= {d: meshes.experts.get_local_rank(d) for d in ("edp", "ep", "etp")}
    pp_rank = coords["pp"]
    ids = stage_ids_for_rank(plan.schedule, plan.pp, plan.vpp, pp_rank)
    costs, embed, head = stage_costs(trainer.model_spec, plan.seq_len)
    layers = split_stages(None, plan.pp, plan.vpp, costs, embed, head)
    stages = {s: layers[s] for s in ids}

    params = {"dense": 0.0, "experts": 0.0}
    count = {"dense": 0, "experts": 0}
    grads = 0.0
    for name, p in model.named_parameters():
        local = _local(p)
        kind = "experts" if ".experts." in name else "dense"
        params[kind] += local.numel() * local.element_size()
        count[kind] += local.numel()
        if p.requires_grad:
            grads += local.numel() * local.element_size()
    param_bytes = 2 if uses_bf16(spec, trainer.device) else 4
    held = plan.schedule in V_SHAPE and plan.zero_stage > 0
    gathered = _gathered_bytes(model, param_bytes, held)
    if held:  # the stage is the FSDP root: gradients stay unsharded (fp32) until the step's single reduction
        grads = _gathered_bytes(model, 4, True)

    from torch.distributed.fsdp import FSDPModule

    root_stages = any(isinstance(st.submod, FSDPModule) for st in getattr(trainer.pipeline, "_stages", []))
    t = time.perf_counter()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    recorder = _CollectiveRecorder(_group_labels(meshes))
    per_step: dict[tuple[str, str], Traffic] = defaultdict(Traffic)
    with fake:
        model.to_empty(device="cpu")
        trainer.optimizer = trainer._build_parallel_optimizer()
        if step:
            m = plan.num_microbatches
            if root_stages:  # zbv / dualpipev: one-time gathers in the first micro-batch, one reduction a step
                runs = [(False, 1), (False, m - 1)] if m > 1 else [(False, 1)]
            else:  # every micro-batch alike (gathers each time) but the last, which reduces the gradients
                runs = [(False, m - 1), (True, 1)] if m > 1 else [(True, 1)]
            for sync, times in runs:
                with recorder:
                    _micro_batch(trainer, sync)
                _accumulate(per_step, recorder, times)
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        with recorder:
            if step:  # the step's end as the trainer runs it (without a step: the optimizer alone, for its states)
                for stage in getattr(trainer.pipeline, "_stages", []):
                    stage.perform_reduce_grad(1)  # the schedule's REDUCE_GRAD action (FSDP roots: zbv / dualpipev)
                if plan.tp_grad_reduce == "deferred":
                    finish_tp_grad_reduce(model)
                params_g = [p for p in model.parameters() if p.grad is not None]
                global_grad_norm(params_g, meshes.pp_group())  # clipping: the norm's collectives, local scaling
            try:
                trainer.optimizer.step()
            except DataDependentOutputException:  # its math reads a value (a step count); the states exist by now
                notes.append(f"{type(trainer.optimizer).__name__}.step reads a value: its update math is not run "
                             "on fake tensors (its states are counted)")
            if step:
                trainer._update_router_biases()
        if step:
            _accumulate(per_step, recorder, 1)
    wall["fake step" if step else "optimizer step"] = time.perf_counter() - t
    optimizer = 0.0
    for state in trainer.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                optimizer += _local(v).numel() * _local(v).element_size()
    if step and trainer.pipeline is not None:
        D = trainer.model_spec.hidden_size
        hidden = plan.micro_batch_size * plan.seq_len // plan.tp * D * param_bytes
        per_step[("send/recv", f"pp({plan.pp})")].add(_p2p_per_step(trainer.pipeline, plan, pp_rank, hidden))
    if step:
        notes.append("routing assumed balanced; stages run one micro-batch each outside the schedule")
        if plan.ep_token_dedup:
            notes.append("ep_token_dedup: no token ids in a dry run, so the all-to-alls are those without dedup")

    t = time.perf_counter()
    try:
        memory, times, by_rank = _planner(plan)
        mine = (by_rank[pp_rank] if pp_rank < len(by_rank) else memory) | {"host": memory["host"]}
    except ConfigError as err:  # e.g. a test plan on the 1-device cpu cluster: nothing to compare with
        mine, times = {}, {}
        notes.append(f"no planner numbers: {err}")
    wall["planner"] = time.perf_counter() - t
    return DryRunReport(plan, trainer.dist.rank, coords, stages, params, count, gathered, grads, optimizer, mine,
                        times, dict(per_step), notes, wall)


def _accumulate(per_step: dict, recorder: _CollectiveRecorder, times: float) -> None:
    for key, t in recorder.traffic.items():
        per_step[key].add(t, times)
    recorder.traffic.clear()


def _micro_batch(trainer, sync: bool) -> None:
    """One micro-batch forward + backward of this rank's part, as the trainer / the schedule run it."""
    plan, spec = trainer.dist.plan, trainer.spec
    mbs, T, V = plan.micro_batch_size, plan.seq_len, trainer.model_spec.vocab_size
    tokens = torch.randint(0, V, (mbs, T))
    runner = trainer.pipeline
    if runner is None:
        set_gradient_sync(trainer.model, sync)
        with trainer.autocast():
            loss = trainer.model(tokens, tokens)
        loss.backward()
        return
    from torch.distributed.fsdp import FSDPModule

    from moestack.parallel.pipeline import stage_state_blocks
    from moestack.train.trainer import uses_bf16

    hidden = torch.bfloat16 if uses_bf16(spec, trainer.device) else torch.float32  # as the trainer's runner
    runner._count = torch.tensor(mbs * T)
    runner._scale = 1.0
    outputs = []
    for stage in runner._stages:  # forward, in stage order (a V-shape rank runs its first chunk first)
        submod = stage.submod
        if isinstance(submod, FSDPModule):  # the stage is the FSDP root (zbv / dualpipev), as stage.py sets it:
            submod.set_is_last_backward(False)  # gathered all step, reduced once by REDUCE_GRAD
            submod.set_reshard_after_backward(False)
            submod.set_requires_gradient_sync(False)
        else:
            set_gradient_sync(submod, True)  # other schedules reduce after every micro-batch's backward
        if stage.is_first:
            x = tokens
        else:  # what the previous stage sends: [mbs, T / tp (sequence parallel), D], with Attention Residuals the
            n_in = stage_state_blocks(submod.part)[0]  # stacked block state [n + 1, mbs, T / tp, D]
            shape = (mbs, T // plan.tp, trainer.model_spec.hidden_size)
            x = torch.empty(shape if n_in < 0 else (n_in + 1, *shape), dtype=hidden, requires_grad=True)
        with trainer.autocast():
            out = submod(x)
            if stage.is_last:
                out = runner._loss_fn(out, tokens)
        outputs.append(out)
    for out in reversed(outputs):
        out.backward(None if out.dim() == 0 else torch.ones_like(out))
