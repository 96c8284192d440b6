"""The training loop: read top to bottom. One code path for a single device and for many ranks.

setup (spec, data, model, optimizer, resume) -> for each step: micro-batches (forward, backward) -> non-finite
check -> clip -> optimizer/scheduler step -> MoE bias update -> metrics / eval / checkpoint -> plot at the end.

With a Plan (`Trainer(..., plan=plan)`, `moestack train --plan plan.yaml` under torchrun) the same loop runs on
plan.devices ranks: meshes from the plan, the model parallelised by `moestack.parallel.parallelize`, each
data-parallel rank reading its own shard of every global batch. The global operations are explicit: the logged
loss is the mean over data-parallel ranks, the clip norm covers every gradient on every mesh
(moestack.parallel.comm), router load counts are summed over all ranks of a pipeline stage before the bias update,
and rank 0 alone logs, plots and prints. Every rank saves and loads the DCP checkpoint; a checkpoint reloads at
another layout (EP / FSDP / DP degree) as long as the global batch is the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moestack.config.base import ConfigError, dump_yaml
from moestack.config.kernel_spec import merge as merge_kernels
from moestack.config.model_spec import ModelSpec
from moestack.config.plan import Plan, runtime_unsupported
from moestack.config.train_spec import TrainSpec
from moestack.memory.compute_weights import ComputeWeights
from moestack.memory.phase_peaks import GIB, PhasePeaks
from moestack.model.aux_loss import aux_loss_scale
from moestack.model.kernels import apply_kernels
from moestack.model.moe import set_jitter_seeds
from moestack.model.transformer import Transformer, build_model
from moestack.parallel import Meshes, build_meshes, parallelize
from moestack.parallel.comm import all_reduce_mean, global_grad_norm
from moestack.parallel.compile import resolve_compile
from moestack.parallel.fsdp import set_gradient_sync, set_reshard_after_backward
from moestack.parallel.init import materialize
from moestack.parallel.tensor import finish_tp_grad_reduce, guard_tp_grad_reduce
from moestack.train.checkpoint import (
    CheckpointError,
    capture_rng_state,
    find_resumable,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    step_dirs_any,
)
from moestack.train.data import build_data, eval_batches
from moestack.train.expert_load import ExpertLoadMonitor, finish_microbatch, reduce_router_state
from moestack.train.fits import check_single_device_fits
from moestack.train.guard import RunGuard
from moestack.train.metrics import MetricsLogger, format_expert_load, plot_loss_curve
from moestack.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from moestack.train.resume_settings import settings_record
from moestack.train.safe_load import read_trust_key
from moestack.train.step_profile import StepProfiler
from moestack.train.step_update import fused_skip_supported, read_stats, step_optimizer
from moestack.train.tokenizer import build_tokenizer


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (e.g. repeated non-finite losses); the message says why and what to do."""


# Dense bf16 tensor-core peaks (vendor datasheets) used as the MFU denominator, as Megatron/torchtitan do.
_PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "H800": 989.4e12, "A100": 312e12, "B200": 2250e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in _PEAK_BF16_FLOPS.items():
        if key in name:
            return peak
    return None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: '{name}' requested but no CUDA device is available; use --device cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device: '{name}' requested but this machine has {torch.cuda.device_count()} CUDA "
                          f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1}); pick one of those")
    return dev


def uses_bf16(spec: TrainSpec, device: torch.device) -> bool:
    return spec.precision in ("bf16", "fp8") or (spec.precision == "auto" and device.type == "cuda")


def weight_dtype(spec: TrainSpec) -> torch.dtype:
    """The dtype of the master weights (and, without bf16 autocast, of the compute)."""
    return torch.float64 if spec.precision == "fp64" else torch.float32


def autocast_context(spec: TrainSpec, device: torch.device):
    if uses_bf16(spec, device):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float
    mfu: float | None
    aux: dict[str, float] = field(default_factory=dict)
    load: str = ""  # expert-load column of the progress bar (the last logging step's worst layer)


class _NullMetrics:
    """The metrics logger of ranks other than 0: they compute the same numbers and write nothing."""

    def log(self, *args, **kwargs) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Distributed:
    """What a multi-rank run adds to the single-device loop (Trainer.dist; None without a plan)."""

    plan: Plan
    meshes: Meshes
    rank: int
    owns_group: bool  # this trainer called init_process_group (and destroys it in close())


NCCL_BACKSTOP_MINUTES = 2.0  # NCCL's timeout beyond timeouts.collective_minutes (_init_distributed)

# above this many parameters the model is built on the meta device and initialised after sharding (GPU only)
META_INIT_PARAMS = 4_000_000_000


def _init_distributed(device: torch.device, plan: Plan, timeout_minutes: float = 10.0) -> tuple[torch.device, bool]:
    """Join (or create) the default process group: NCCL on CUDA, gloo on CPU, collectives bounded by
    timeout_minutes (TrainSpec.timeouts; NCCL gets NCCL_BACKSTOP_MINUTES more: its collectives are asynchronous, so
    the host waits in a CUDA sync that only moestack's watchdog can report, moestack/train/guard.py, and NCCL's
    teardown is the backstop). Returns (this rank's device, owns)."""
    world = os.environ.get("WORLD_SIZE")
    if "RANK" in os.environ and world is not None and world.isdigit() and int(world) != plan.devices:
        raise ConfigError(f"--plan: the plan lays out {plan.devices} ranks but the launcher started {world}; run "
                          f"torchrun --nproc-per-node {plan.devices} (per node), or plan for {world} devices")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        # a timed-out NCCL collective aborts the communicators and ends the process instead of hanging
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if dist.is_initialized():
        return device, False
    if "RANK" not in os.environ:
        if plan.devices > 1:
            raise ConfigError(f"--plan: the plan needs {plan.devices} ranks; launch with torchrun --nproc-per-node "
                              f"{plan.devices} -m moestack train --plan ...")
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    backend = "nccl" if device.type == "cuda" else "gloo"
    backstop = NCCL_BACKSTOP_MINUTES if backend == "nccl" else 0.0
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None,
                            timeout=timedelta(minutes=timeout_minutes + backstop))
    return device, True


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ep_domain_size(plan: Plan) -> int | None:
    """EP ranks per fast domain for the hierarchical dispatcher: plan.ep_domain_size, else the innermost network
    tier of the plan's cluster, else the ranks per node (LOCAL_WORLD_SIZE); capped at ep."""
    if plan.dispatcher != "hierarchical":
        return None
    size = plan.ep_domain_size
    if size is None:
        try:
            from moestack.config.cluster import load_cluster_spec

            tiers = load_cluster_spec(plan.cluster).tiers
            size = tiers[0].domain_size if tiers else None
        except (ConfigError, ValueError, FileNotFoundError):
            size = None
    size = int(size or os.environ.get("LOCAL_WORLD_SIZE", plan.ep))
    size = min(size, plan.ep)
    if plan.ep % size:
        raise ConfigError(f"plan.dispatcher: hierarchical EP needs the domain size ({size}) to divide ep ({plan.ep}); "
                          "set plan.ep_domain_size to a divisor of ep")
    return size


def apply_plan_to_spec(spec: TrainSpec, plan: Plan) -> TrainSpec:
    """The plan owns the batch layout: micro-batch size, micro-batches per step (gradient accumulation, or the
    pipeline schedule's micro-batches when pp > 1) and sequence length; a plan with precision fp8 runs the FP8
    recipe (moestack/ops/fp8/convert.py); the plan's kernel choices apply where the train spec leaves "auto"; a plan
    priced for compiled blocks (host_profile blocks) compiles them unless the train spec names a compile mode."""
    unsupported = runtime_unsupported(plan)
    if unsupported:
        raise ConfigError(f"plan: the trainer cannot run {'; '.join(unsupported)}")
    update = {"micro_batch_size": plan.micro_batch_size, "grad_accum_steps": plan.num_microbatches,
              "seq_len": plan.seq_len, "kernels": merge_kernels(spec.kernels, plan.kernels)}
    if plan.precision == "fp8":
        if spec.precision in ("fp32", "fp64"):
            raise ConfigError(f"precision: the plan says fp8 but the train spec says {spec.precision}; drop "
                              f"--precision {spec.precision} or plan with --precision bf16")
        update["precision"] = "fp8"
    if plan.host_profile == "blocks":
        if "compile" not in spec.model_fields_set:
            update["compile"] = spec.compile.model_copy(update={"mode": "blocks"})
        elif spec.compile.mode == "none":
            raise ConfigError("compile: the plan was priced for compiled blocks (host_profile blocks) but the train "
                              "spec says none; drop the compile setting or plan with --host-profile eager")
    return spec.model_copy(update=update)


def adapt_sampler_state(state: dict, batch_size: int, world_size: int) -> dict:
    """A BatchSampler state saved at another data-parallel layout, converted to (batch_size, world_size).

    Batch p of an epoch covers the windows [p*B*W, (p+1)*B*W) of the epoch's permutation on W ranks of batch B
    (rank r takes every W-th), so the position converts through the windows consumed. The data order is exactly
    the same when B*W is unchanged (the usual case: same global batch, other EP / FSDP / DP degrees).
    """
    saved_rows, rows = state["batch_size"] * state["world_size"], batch_size * world_size
    consumed = state["position"] * saved_rows
    if consumed % rows:
        raise ConfigError(f"resume: the checkpoint consumed {consumed} sequences of this epoch, not a multiple of "
                          f"micro_batch_size*dp = {rows}; resume with a global batch layout that divides it")
    return {**state, "batch_size": batch_size, "world_size": world_size, "position": consumed // rows}


class Trainer:
    def __init__(self, spec: TrainSpec, model_spec: ModelSpec, log=print, plan: Plan | None = None,
                 dry_run: bool = False):
        self.model_spec = model_spec
        self.device = resolve_device(spec.device)
        self.dist: Distributed | None = None
        if plan is not None:
            spec = apply_plan_to_spec(spec, plan)
            # what parallelize() applies and plan.yaml records: the merged kernel choices, and fp8 if the spec asks
            plan = plan.model_copy(update={"kernels": spec.kernels,
                                           "precision": "fp8" if spec.precision == "fp8" else plan.precision})
            self.device, owns = _init_distributed(self.device, plan, spec.timeouts.collective_minutes)
            meshes = build_meshes(plan, self.device.type, ep_domain_size=_ep_domain_size(plan))
            self.dist = Distributed(plan, meshes, dist.get_rank(), owns)
        self.spec = spec
        self.plan = plan
        self.is_main = self.dist is None or self.dist.rank == 0
        self.log = log if self.is_main else (lambda *args, **kwargs: None)
        self.out_dir = Path(spec.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self._trust_key = read_trust_key(spec.checkpoint.trust_key_file)
        self._last_ckpt: Path | None = None
        self._resumed = False
        self._guard = RunGuard(self.out_dir, spec.timeouts, self.dist.rank if self.dist else 0,
                               dist.get_world_size() if self.dist else 1, self.device, self._where)
        self.autocast = autocast_context(spec, self.device)
        if spec.seq_len > model_spec.max_seq_len:
            raise ConfigError(
                f"seq_len: {spec.seq_len} exceeds model max_seq_len {model_spec.max_seq_len}; lower --seq-len"
            )

        torch.manual_seed(spec.seed)  # the same on every rank: every rank initialises the same full weights
        self.pipeline = None  # moestack.parallel.pipeline.PipelineStepRunner when plan.pp > 1
        self._init_extra: dict = {}  # kept in every checkpoint: the HF layout of --init-from weights (export)
        self.compute_weights: ComputeWeights | None = None  # bf16 weight copies (spec.weight_cache, one device)
        self.compiled = resolve_compile(spec.compile, self.device, sharded=self.dist is not None)
        if dry_run:  # moestack/train/dry_run.py: only this rank's model, parallelised on meta
            assert self.dist is not None, "a dry run needs a plan"
            self.model = self._build_parallel_model(materialise=False)
            self.replanner = None
            self.load_monitor = self._build_load_monitor()  # reads the plan's load forecast, as a run does
            return
        self.tokenizer = build_tokenizer(spec.data)
        if self.tokenizer.vocab_size > model_spec.vocab_size:
            raise ConfigError(
                f"model.vocab_size: {model_spec.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({self.tokenizer.vocab_size}); use a model with a larger vocab or another tokenizer"
            )
        dp_rank, dp = (self.dist.meshes.dp_rank, plan.dp) if self.dist else (0, 1)
        self.sampler, eval_tokens = build_data(
            spec.data, self.tokenizer, spec.seq_len, spec.micro_batch_size, spec.seed, model_spec.vocab_size,
            rank=dp_rank, world_size=dp,
        )
        # eval_fraction = 0 means no held-out data: evaluation is skipped
        self.eval_set = (
            eval_batches(eval_tokens, spec.seq_len, spec.micro_batch_size, spec.eval_batches)
            if len(eval_tokens) > spec.seq_len
            else []
        )

        if self.dist is None:
            check_single_device_fits(model_spec, self.device)  # one line, not an allocator traceback
            self.model: Transformer = build_model(model_spec, self.device, seed=spec.seed)
            if spec.precision == "fp64":
                self.model.double()
            self._init_weights(self.model)
            self._configure_qat(self.model)
            self._configure_dsa()
            self._configure_fp8(self.model)
            self._configure_kernels(self.model)
            self.optimizer = build_optimizer(self.model, spec.optimizer, self.kernels.choices["adamw.backend"].runs)
            if spec.weight_cache and uses_bf16(spec, self.device):
                self.compute_weights = ComputeWeights(self.model, self.optimizer)
            self.compiled.apply(self.model)
        else:
            self.model = self._build_parallel_model()
            self.optimizer = self._build_parallel_optimizer()
            guard_tp_grad_reduce(self.optimizer, self.model)  # plan.tp_grad_reduce deferred: no step on partial sums
            torch.manual_seed(spec.seed + 1_000_003 * self.dist.rank)  # runtime randomness differs per rank
        if spec.compile.mode != "none":
            self.log(self.compiled.report.line())
        if self.pipeline is not None and self.eval_set:
            self.log("evaluation is skipped under pipeline parallelism (the step runner has no forward-only path)")
            self.eval_set = []
        self.scheduler = build_scheduler(self.optimizer, spec.schedule, spec.steps, spec.optimizer.lr)
        self.step = 0
        self.tokens_per_step = spec.tokens_per_step * dp  # global
        self.flops_per_token = _train_flops_per_token(model_spec, spec.seq_len)
        self.peak_flops = device_peak_flops(self.device)
        self.num_devices = plan.devices if plan is not None else 1
        self.metrics = _NullMetrics()  # rank 0 opens metrics.jsonl when the run starts (fit), at its first step
        self.replanner = self._build_replanner()
        self.load_monitor = self._build_load_monitor()
        self._phase_peaks: PhasePeaks | None = None  # active during spec.phase_peaks_step only
        self._peak_floor = 0  # bytes: the run's peak up to the phase-peaks step (whose resets hide it from torch)

    # ----------------------------------------------------------------------------------------------- setup
    def _build_replanner(self):
        """Hot-expert replication's re-planning (plan.ep_replicas > 0), else None."""
        if self.plan is None or not self.plan.ep_replicas:
            return None
        from moestack.parallel.replicate import Replanner, replicated_layers

        return Replanner(replicated_layers(self.model), self.plan.ep_replan_every)

    def _build_load_monitor(self) -> ExpertLoadMonitor | None:
        moes = self.model.moe_layers()
        if not moes:
            return None
        lg, ep = self.spec.logging, self.plan.ep if self.plan is not None else 1
        rank_load = self.replanner.rank_load if self.replanner is not None else None
        return ExpertLoadMonitor(list(moes), self.model_spec.moe.num_experts, lg.collapse_idle_fraction,
                                 lg.collapse_window, ep=ep, rank_load=rank_load, warn=self.log,
                                 forecast=self.plan.moe_load_imbalance if self.plan is not None else None)

    def _init_weights(self, model: Transformer, sharded: bool = False, partial: bool = False) -> None:
        """spec.init_from: the model weights from a checkpoint or HF directory (moestack/train/init_from.py)."""
        if self.spec.init_from is None:
            return
        from moestack.train.init_from import load_initial_weights

        result = load_initial_weights(model, self.spec.init_from, sharded=sharded, partial=partial,
                                      trust_key=self._trust_key)
        self._init_extra = result.extra
        if result.skipped_line:
            self.log(result.skipped_line)
        self.log(result.message)

    def _configure_qat(self, model: Transformer) -> None:
        """spec.qat mxfp4_experts: every routed-expert module fake-quantises its weights to MXFP4."""
        if self.spec.qat == "none":
            return
        from moestack.ops.mxfp4 import GROUP

        widths = {m.experts.w_gate_up.shape[-1] for m in model.moe_layers().values()} | \
            {m.experts.w_down.shape[-1] for m in model.moe_layers().values()}
        bad = sorted(w for w in widths if w % GROUP)
        if bad:
            raise ConfigError(f"qat: mxfp4_experts needs expert widths (latent / hidden and intermediate sizes) that "
                              f"are multiples of {GROUP}; this model has {', '.join(map(str, bad))}")
        for moe in model.moe_layers().values():
            moe.experts.fake_quant = "mxfp4"
        self.log(f"qat: routed experts of {len(model.moe_layers())} MoE layers train on their MXFP4 values")

    def _configure_dsa(self, model: Transformer | None = None) -> None:
        model = model if model is not None else self.model
        dsa = self.spec.dsa
        for layer in model.dsa_layers().values():
            layer.sparse = dsa.mode == "sparse"
            layer.indexer_loss_coef = dsa.indexer_loss_coef
        if dsa.mode == "dense" and dsa.freeze_main_in_dense and model.dsa_layers():
            for name, p in model.named_parameters():
                p.requires_grad_(".indexer." in name)

    def _configure_fp8(self, model: Transformer) -> None:
        """The single-device build's precision converter (moestack/ops/fp8/convert.py; parallelize() applies it on
        the parallel path): precision fp8 puts the routed experts and the large projections in e4m3."""
        from moestack.ops.fp8.convert import convert_precision

        report = convert_precision(model, self.spec.precision, self.device, self.spec.kernels.fp8)
        if report is not None:
            self.log(report.summary())

    def _configure_kernels(self, model: Transformer) -> None:
        """spec.kernels (with the documented environment overrides) resolved for this device once, set on the
        model's modules (moestack/model/kernels.py); recorded in out_dir/kernels.json by fit()."""
        self.kernels = apply_kernels(model, self.spec.kernels, self.device)
        self.log(self.kernels.summary())

    def _build_parallel_model(self, materialise: bool = True) -> Transformer:
        """Build, then parallelise as the plan says. A model that fits is built whole from the seed on every rank and
        then sharded by slicing; a larger one (spec.meta_init) is built on meta, sharded, and each rank draws only
        its shards (moestack/parallel/init.py): the same values either way. materialise=False (the dry run) leaves
        the parallelised model on meta."""
        spec, plan, meshes = self.spec, self.dist.plan, self.dist.meshes
        param_dtype = torch.bfloat16 if uses_bf16(spec, self.device) else None
        model = build_model(self.model_spec, "meta")
        big = self.device.type == "cuda" and count_params(model) > META_INIT_PARAMS
        on_meta = not materialise or spec.meta_init == "on" or (spec.meta_init == "auto" and big)
        if not on_meta:
            model = build_model(self.model_spec, self.device, seed=spec.seed)
        if spec.precision == "fp64":
            model.double()
        if not on_meta:
            self._init_weights(model)  # into the whole model: the sharding below slices the loaded weights
        whole = model
        self._configure_qat(model)
        self._configure_dsa(model)
        self._configure_kernels(model)
        if plan.pp > 1:
            model = self._pipeline_stages(model, param_dtype)
        else:
            parallelize(model, plan, meshes, param_dtype=param_dtype, compiled=self.compiled)  # fp8 converts first
            if getattr(model, "fp8_report", None) is not None:
                self.log(model.fp8_report.summary())
        if on_meta and materialise:
            materialize(model, whole, self.device, spec.seed)
            self._init_weights(model, sharded=True, partial=plan.pp > 1)  # a moestack checkpoint, resharded by DCP
        self.whole_model = whole  # the whole tree (other pipeline stages stay on meta): what materialize initialises
        return model

    def _pipeline_stages(self, model: Transformer, param_dtype: torch.dtype | None) -> Transformer:
        """Cut this rank's pipeline stages out of `model`, parallelise each, and set up the step runner.

        Returns one Transformer holding all of this rank's layers (plus the embedding / head where its stages have
        them), sharing their modules, with the FQNs of the whole model: the view the optimizer, clipping, router
        updates and checkpoints work on. The runner drives the stage modules themselves.
        """
        from torch.distributed.fsdp import register_fsdp_forward_method

        from moestack.parallel.pipeline import (
            PipelineStepRunner,
            build_stage_modules,
            split_stages,
            stage_costs,
            stage_ids_for_rank,
        )

        plan, meshes = self.dist.plan, self.dist.meshes
        S = plan.pp * plan.vpp
        costs, embed, head = stage_costs(self.model_spec, self.spec.seq_len)
        layers = split_stages(model, plan.pp, plan.vpp, costs, embed, head)
        ids = stage_ids_for_rank(plan.schedule, plan.pp, plan.vpp, meshes.dense.get_local_rank("pp"))
        parts = [build_stage_modules(model, layers[s], s == 0, s == S - 1) for s in ids]
        for part in parts:
            parallelize(part, plan, meshes, param_dtype=param_dtype, compiled=self.compiled)
            register_fsdp_forward_method(part, "hidden_states")  # the stage runs hidden_states, not forward
        self.pipeline = PipelineStepRunner(parts, ids, plan, meshes.pp_group(), self.device,
                                           seq_shards=plan.tp, hidden_dtype=param_dtype or weight_dtype(self.spec))
        mine = sorted(i for s in ids for i in layers[s])
        return build_stage_modules(model, mine, 0 in ids, S - 1 in ids)

    def _build_parallel_optimizer(self) -> torch.optim.Optimizer:
        plan = self.dist.plan
        if plan.offload.optimizer or plan.offload.experts:
            # host-resident state / parameters step with torch's fused CPU kernels (moestack.memory.host_adamw:
            # the generic CPU paths are far slower, moestack/memory/README.md)
            from moestack.train.optimizers import build_host_aware_optimizer

            return build_host_aware_optimizer(self.model, plan.optimizer, self.spec.optimizer,
                                              offload=plan.offload.optimizer, seed=self.spec.seed)
        if plan.optimizer == "adamw":
            return build_optimizer(self.model, self.spec.optimizer)
        from moestack.train.optimizers import build_optimizer_from_name

        return build_optimizer_from_name(self.model, plan.optimizer, self.spec.optimizer, seed=self.spec.seed)

    def close(self) -> None:
        """Release the run directory and the process group if this trainer created it (not after a peer failed:
        destroying could wait on it)."""
        self._guard.release()
        if self.dist is not None and self.dist.owns_group and dist.is_initialized() and not self._guard.failed:
            dist.destroy_process_group()

    def _where(self) -> str:
        """For the one-line reports of a stalled or failed run: the step and the last checkpoint."""
        ckpt = self._last_ckpt or latest_checkpoint(self.ckpt_dir)
        return (f"during step {self.step + 1} ({self.step} completed); last checkpoint: "
                f"{ckpt if ckpt is not None else 'none written yet'}")

    def resume(self, path: Path | None = None) -> bool:
        """Load `path` or the newest intact checkpoint under out_dir; False if there is none.

        Newer checkpoints that fail verification are skipped with a line each saying why (a crafted or unsigned
        one is refused instead); broken ones and no intact one raise CheckpointError.
        The checkpoint may come from another layout (EP / FSDP / DP degrees, or a single device): DCP reshards the
        tensors, and the data position converts to this layout (adapt_sampler_state)."""
        self._guard.claim()
        try:
            return self._resume(path)
        except BaseException:
            self._guard.release()  # a refused checkpoint leaves the folder free, nothing half-claimed
            raise

    def _resume(self, path: Path | None) -> bool:
        from moestack.train.resume_settings import apply_resume_settings, check_resume_settings, saved_extra

        if path is None:
            path, notes = find_resumable(self.ckpt_dir, self._trust_key)
            for note in notes:
                self.log(f"resume: {note}")
        if path is None:
            return False
        check_resume_settings(path, saved_extra(path), self.spec, self.plan)  # before the state replaces ours
        extra = load_checkpoint(path, self.model, self.optimizer, partial=self.pipeline is not None,
                                trust_key=self._trust_key)
        if self.pipeline is not None:  # tied embeddings: the two copies (first / last stage) must have loaded equal
            differ = self.pipeline.loaded_tie_mismatch(self.optimizer)
            if differ:
                raise CheckpointError(f"checkpoint {path}: the tied weight's copies 'embed.weight' and "
                                      f"'lm_head.weight' differ after loading ({', '.join(differ)}); the model "
                                      "ties them (tie_word_embeddings), so the checkpoint is damaged: move it out "
                                      f"of {Path(path).parent} to resume from the one before")
        self.scheduler.load_state_dict(extra["scheduler"])
        for line in apply_resume_settings(self.optimizer, self.scheduler, extra, self.spec):  # this run's values
            self.log(line)
        self.sampler.load_state_dict(
            adapt_sampler_state(extra["sampler"], self.sampler.batch_size, self.sampler.world_size))
        rng = extra["rng"]
        ranks = extra.get("rng_ranks")
        if self.dist is not None and ranks is not None and len(ranks) == dist.get_world_size():
            rng = ranks[self.dist.rank]
        restore_rng_state(rng)
        if self.compute_weights is not None:
            self.compute_weights.mark_stale()
        self.step = int(extra["step"])
        self._last_ckpt, self._resumed = Path(path), True
        self._guard.mark(self.step)
        if self.spec.init_from is not None:
            self.log(f"--init-from {self.spec.init_from}: not used, the run's own checkpoint continues it")
        self.log(f"resumed from {path} at step {self.step}")
        return True

    def save(self) -> Path:
        extra = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": capture_rng_state(),
            "model_name": self.model_spec.name,
            "train_settings": settings_record(self.spec, self.plan),
            **self._init_extra,
        }
        if self.dist is not None:
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, extra["rng"])
            extra["rng_ranks"] = states
            extra["layout"] = self.dist.plan.short()
        self._guard.mark()
        self._last_ckpt = save_checkpoint(self.ckpt_dir, self.step, self.model, self.optimizer, extra,
                                          self.spec.checkpoint.keep, trust_key=self._trust_key)
        self.metrics.sync()  # the metrics up to a checkpoint are as durable as the checkpoint
        self._guard.mark()
        return self._last_ckpt

    # ----------------------------------------------------------------------------------------------- steps
    def _forward_backward(self) -> torch.Tensor:
        """Every micro-batch's forward and backward; returns the step's mean loss as a float64 scalar (on the device:
        no host read here, moestack/train/step_update.py)."""
        accum = self.spec.grad_accum_steps
        if self.pipeline is not None:  # the schedule runs the plan's micro-batches of the whole local batch
            batches = [self.sampler.next_batch() for _ in range(accum)]
            inputs, targets = (torch.cat(parts) for parts in zip(*batches))
            if self._phase_peaks is not None:  # forwards and backwards interleave: stage and layer marks only
                self._phase_peaks.in_forward = True
            with self.autocast():
                total = self.pipeline.forward_backward(inputs, targets)
            return torch.tensor(all_reduce_mean(total, self.dist.meshes.dp_group, self.device), dtype=torch.float64)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.compiled is not None:
            self.compiled.own_gradients(self._autograd_filled_params(), accum)
        for i in range(accum):
            set_gradient_sync(self.model, i == accum - 1)  # FSDP: reduce gradients once, after the last one
            if self.dist is not None and self.dist.plan.zero_stage < 3:  # keep the bf16 gathers for the next one
                set_reshard_after_backward(self.model, i == accum - 1)
            inputs, targets = self.sampler.next_batch()
            inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
            peaks, mb = self._phase_peaks, f" (mb {i})" if accum > 1 else ""
            if peaks is not None:
                peaks.mark(f"forward{mb}")
                peaks.in_forward = True
            if self.compiled is not None:
                self.compiled.before_forward()  # CUDA graphs: a new micro-batch, earlier outputs are consumed
            with self.autocast(), aux_loss_scale(1.0 / accum):  # read by the forward's aux losses
                loss = self.model(inputs, targets)
            if peaks is not None:
                peaks.in_forward = False
                peaks.mark(f"loss + head backward{mb}")
            (loss / accum).backward()
            finish_microbatch(self.model.moe_layers())
            total += loss.detach().double() / accum  # the float64 sums the host did before, on the device
        if self.dist is not None:  # each rank's loss is the mean over its own tokens: average over dp ranks
            dist.all_reduce(total, group=self.dist.meshes.dp_group)  # SUM: gloo has no AVG
            total = total / dist.get_world_size(self.dist.meshes.dp_group)
        return total

    def _autograd_filled_params(self) -> Iterator[torch.Tensor]:
        """The parameters whose .grad AccumulateGrad fills: all but the weight cache's (its hooks write theirs).
        A generator: nothing is scanned unless the caller iterates."""
        cached = self.compute_weights.params() if self.compute_weights is not None else set()
        yield from (p for p in self.model.parameters() if id(p) not in cached)

    def _grad_norm(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """(global gradient norm, whether the gradients were clipped already). One device with an optimizer that
        takes the clip in its kernel (step_update): the norm only; else the norm and the clip, on the device."""
        if self.dist is not None:
            return global_grad_norm(params, self.dist.meshes.pp_group()), False
        if fused_skip_supported(self.optimizer) and self.spec.optimizer.grad_clip > 0:
            return torch.nn.utils.get_total_norm([p.grad for p in params]).float(), False
        return clip_grad_norm(params, self.spec.optimizer.grad_clip), True

    def _update_router_biases(self) -> dict[str, torch.Tensor]:
        moes = self.model.moe_layers()
        if self.dist is not None and moes:  # every rank must move the biases the same way: global counts
            reduce_router_state(moes, self.dist.meshes.stage_group)
        return {name: moe.router.update_selection_bias() for name, moe in moes.items()}

    def train_step(self) -> StepStats | None:
        """One optimizer step. Returns None when the step was skipped for a non-finite loss or gradient.

        Host reads: one, at the end (loss, norm, skip flag, aux losses together), after the update was queued;
        optimizers without an on-device skip read the skip flag once more before stepping (step_update.py)."""
        t0 = time.perf_counter()
        self.model.train()
        if self.compute_weights is not None:
            self.compute_weights.refresh_if_stale()  # bf16 copies, once per optimizer step
        set_jitter_seeds({name: moe.router for name, moe in self.model.moe_layers().items()}, self.step)
        loss = self._forward_backward()
        if self._phase_peaks is not None:
            self._phase_peaks.in_forward = False
            self._phase_peaks.mark("clip + optimizer")
        if self.plan is not None and self.plan.tp_grad_reduce == "deferred":
            finish_tp_grad_reduce(self.model)  # the TP gradient sums, before .grad is read
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm, clipped = self._grad_norm(params)
        finite = torch.isfinite(loss.to(grad_norm.device)) & torch.isfinite(grad_norm)
        stepped = step_optimizer(self.optimizer, params, grad_norm, finite, self.spec.optimizer.grad_clip, clipped)
        stats = read_stats({"loss": loss, "grad_norm": grad_norm, "finite": finite, **self._aux()})
        self.optimizer.zero_grad(set_to_none=True)
        if not (stepped if stepped is not None else stats.pop("finite") > 0):
            for moe in self.model.moe_layers().values():
                moe.router.reset_step_state()
            return None
        stats.pop("finite", None)
        self.scheduler.step()
        counts = self._update_router_biases()
        if self.replanner is not None:
            self.replanner.after_step(counts)
        dt = time.perf_counter() - t0
        tokens_per_s = self.tokens_per_step / dt
        mfu = tokens_per_s * self.flops_per_token / (self.peak_flops * self.num_devices) if self.peak_flops else None
        self._last_counts = counts
        loss_value, norm_value = stats.pop("loss"), stats.pop("grad_norm")
        return StepStats(loss_value, norm_value, self.scheduler.get_last_lr()[0], tokens_per_s, mfu, stats)

    # ----------------------------------------------------------------------------------------------- diagnostics
    def _start_phase_peaks(self) -> None:
        """Arm PhasePeaks for the coming step (spec.phase_peaks_step): gradient hooks on the blocks this rank holds
        (under PP the stage view `self.model` shares them with the stage modules) and, under PP, marks around each
        stage forward. Only hooks and allocator peak resets: the step's numbers are unchanged."""
        stage_marks, last = None, None
        if self.pipeline is not None:  # the modules the PipelineStages run (one call per micro-batch forward)
            stages = getattr(self.pipeline, "_stages", [])
            stage_marks = {sid: st.submod for sid, st in zip(self.pipeline.stage_ids, stages, strict=False)}
            last = self.pipeline.num_stages - 1
        self._phase_peaks = PhasePeaks(self.model, self.device, microbatches=self.spec.grad_accum_steps,
                                       stage_marks=stage_marks, last_stage=last)

    def _finish_phase_peaks(self) -> None:
        """Close the marks, write out_dir/phase_peaks_rank{r}.json on every rank, log rank 0's largest phase, and
        keep the run's peak so far (the resets hid it from torch.cuda.max_memory_allocated) as the reporting floor."""
        peaks, self._phase_peaks = self._phase_peaks, None
        if peaks is None:
            return
        marks = peaks.close()
        if self.device.type == "cuda":
            self._peak_floor = max(self._peak_floor, peaks.run_peak_bytes)
        rank = self.dist.rank if self.dist is not None else 0
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"phase_peaks_rank{rank}.json").write_text(json.dumps(marks, indent=1))
        top = peaks.largest()
        if top is not None:
            note = "" if self.device.type == "cuda" else " (no CUDA allocator: all phases read 0)"
            self.log(f"phase peaks, step {self.spec.phase_peaks_step}, rank 0: largest '{top['phase']}' "
                     f"{top['peak_gib']:.2f} GiB (end {top['end_gib']:.2f}) of {len(marks)} phases{note}; every "
                     f"rank: {self.out_dir}/phase_peaks_rank{{r}}.json")

    def _aux(self) -> dict[str, torch.Tensor]:
        """The last micro-batch's aux losses (mean over layers), as device scalars for read_stats."""
        out = {}
        moes = self.model.moe_layers().values()
        for key, values in (("moe_aux_loss", [m.last_aux_loss for m in moes]),
                            ("moe_global_aux_loss", [m.last_global_aux_loss for m in moes]),
                            ("router_z_loss", [m.router.last_z_loss for m in moes])):
            values = [v for v in values if v is not None]
            if values:
                out[key] = torch.stack([v.float() for v in values]).mean()
        idx_loss = [
            a.last_indexer_loss for a in self.model.dsa_layers().values() if a.last_indexer_loss is not None
        ]
        if idx_loss:
            out["indexer_kl"] = torch.stack([a.float() for a in idx_loss]).mean()
        return out

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the eval batches (every rank evaluates all of them: the same number everywhere)."""
        self.model.eval()
        if self.compute_weights is not None:
            self.compute_weights.refresh_if_stale()
        losses = []
        for inputs, targets in self.eval_set:
            with self.autocast():
                losses.append(float(self.model(inputs.to(self.device), targets.to(self.device))))
        self.model.train()
        return sum(losses) / len(losses)

    # ----------------------------------------------------------------------------------------------- loop
    def fit(self, progress=None) -> dict:
        spec = self.spec
        self._guard.claim()
        try:
            if self.step == 0 and not self._resumed and step_dirs_any(self.ckpt_dir):
                newest = step_dirs_any(self.ckpt_dir)[0][1]
                raise ConfigError(f"out_dir: '{self.out_dir}' holds checkpoints of an earlier run (newest "
                                  f"{newest.name}); continue it with --resume, or train into a new --out (a new run "
                                  "here would mix with them)")
            if self.is_main:
                self.metrics = MetricsLogger(self.out_dir, tensorboard=spec.logging.tensorboard,
                                             start_step=self.step)
                later, torn = self.metrics.dropped
                if later or torn:
                    self.log(f"metrics.jsonl: dropped {later} record(s) after step {self.step} (replayed by this "
                             "run)" + (f" and {torn} torn line(s)" if torn else ""))
            return self._fit(progress)
        except Exception as err:
            failure = self._guard.failure(err)
            if failure is not None:
                raise failure from err
            raise
        finally:
            self.metrics.close()
            self._guard.release()

    def _fit(self, progress) -> dict:
        spec = self.spec
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            dump_yaml(spec, self.out_dir / "train.yaml")
            dump_yaml(self.model_spec, self.out_dir / "model.yaml")
            if self.plan is not None:
                dump_yaml(self.plan, self.out_dir / "plan.yaml")
            self._write_kernels()
            self.compiled.write(self.out_dir)
        profiler = StepProfiler.maybe(spec.profile_window, self.out_dir, self.device,
                                      self.dist.rank if self.dist is not None else 0)
        try:
            history, last_ckpt = self._loop(progress, profiler)
        except BaseException:
            if profiler is not None:
                profiler.abort()
            raise
        if profiler is not None:
            profiler.finish()  # a window reaching past the last step (e.g. after --resume) ends with the run
        if self.is_main:
            self.compiled.write(self.out_dir)  # with what dynamo did (graphs, breaks)
        self.metrics.close()
        self._write_kernels()  # again: with the `moestack tune` cache entries the run followed
        plot = plot_loss_curve(self.out_dir / "metrics.jsonl", self.out_dir / "loss.png") if self.is_main else None
        load = format_expert_load(getattr(self, "_last_counts", {}))
        heatmap = self.load_monitor.heatmap(self.out_dir / "expert_load.png") \
            if self.is_main and self.load_monitor is not None else None
        return {"losses": history, "checkpoint": last_ckpt, "plot": plot, "metrics": self.out_dir / "metrics.jsonl",
                "expert_load": load, "load_heatmap": heatmap}

    def _write_kernels(self) -> None:
        """out_dir/kernels.json: the resolved kernel choices (and tune-cache hits so far), rank 0 only."""
        if self.is_main and getattr(self, "kernels", None) is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.kernels.write(self.out_dir / "kernels.json")

    def _loop(self, progress, profiler: StepProfiler | None) -> tuple[list[float], Path | None]:
        spec = self.spec
        bad_steps, last_ckpt, history = 0, latest_checkpoint(self.ckpt_dir), []
        self._last_ckpt = self._last_ckpt or last_ckpt
        self._guard.mark(self.step)
        while self.step < spec.steps:
            phase_step = spec.phase_peaks_step is not None and self.step + 1 == spec.phase_peaks_step
            if phase_step:
                self._start_phase_peaks()
            try:
                if profiler is None:
                    stats = self.train_step()
                else:  # --profile-steps: the profiler runs around the train_step calls of steps A..B-1
                    with profiler.step(self.step + 1):
                        stats = self.train_step()
                    profiler.after(self.step + 1 if stats is not None else None)
            finally:
                if phase_step:
                    self._finish_phase_peaks()
            if stats is None:
                bad_steps += 1
                self._guard.mark()
                self.metrics.log(self.step + 1, {"skipped_nonfinite": 1.0})  # the step that was attempted
                self.log(f"step {self.step + 1}: non-finite loss or gradient, step skipped ({bad_steps} in a row)")
                if bad_steps >= spec.max_bad_steps:
                    where = f"last good checkpoint: {last_ckpt}" if last_ckpt else "no checkpoint was written"
                    lr = self.spec.optimizer.lr
                    raise TrainingStopped(
                        f"stopped after {bad_steps} consecutive non-finite steps at step {self.step + 1}; {where}. "
                        f"Lower the learning rate (now {lr:.3g}) or check the data, then continue with --resume "
                        f"--lr {lr / 10:.3g} (resume applies the new value)"
                    )
                continue
            bad_steps = 0
            self.step += 1
            self._guard.mark(self.step)
            if self.step == 1:
                self._write_kernels()  # the first step's tune-cache hits (a later crash keeps them)
            history.append(stats.loss)
            record = {"loss": stats.loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
                      "tokens_per_s": stats.tokens_per_s, **stats.aux}
            if stats.mfu is not None:
                record["mfu"] = stats.mfu
            if self.device.type == "cuda":  # the floor keeps the peak that the phase-peaks step's resets hide
                record["peak_mem_gib"] = max(self._peak_floor, torch.cuda.max_memory_allocated(self.device)) / GIB
            if self.step % spec.logging.every == 0 or self.step == spec.steps:
                if self.load_monitor is not None:
                    record.update(self.load_monitor.observe(self.step, self._last_counts))
                self.metrics.log(self.step, record)
            if self.load_monitor is not None:
                stats.load = self.load_monitor.column
            if progress is not None and self.is_main:
                progress(self.step, stats)
            due_eval = (spec.eval_every and self.step % spec.eval_every == 0) or self.step == spec.steps
            if due_eval and self.eval_set:
                self.metrics.log(self.step, {"loss": self.evaluate()}, prefix="eval")
                self._guard.mark()
            if (spec.checkpoint.every and self.step % spec.checkpoint.every == 0) or (
                self.step == spec.steps and spec.checkpoint.save_final
            ):
                last_ckpt = self.save()
        return history, last_ckpt


def _train_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    from moestack.planner.profile import profile_model

    return profile_model(spec, seq_len).train_flops_per_token


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
