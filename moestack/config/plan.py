"""Plan: how one training run is laid out on a cluster (what `moestack plan` writes and `moestack train` reads).

Two meshes share the same devices ("parallel folding"):
  attention / dense part:  pp x dp_replicate x dp_shard x cp x tp   == devices
  routed experts:          pp x edp x ep x etp                      == devices   (edp is derived)
`dp_shard` is the group ZeRO shards over (FSDP2); `dp_replicate` holds plain replicas (HSDP when both > 1).
A plan may carry the planner's prediction (`predicted`); it is informational and ignored by `train`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from moestack.config.base import ConfigError, StrictModel, dump_yaml, read_yaml, validate
from moestack.config.kernel_spec import KernelSpec

RecomputeMode = Literal["none", "selective", "full"]
# GEMM recipes: bf16; fp8 = moestack's recipe (moestack/ops/fp8: e4m3 with DeepSeek-V3's blockwise scales, 1x128
# activations / 128x128 weights); fp8_tensorwise = one scale per tensor (Transformer Engine's delayed / current
# scaling); mxfp8 = OCP microscaling, e4m3 with an e8m0 scale per 32 elements (Blackwell); nvfp4 = e2m1 with an e4m3
# scale per 16 elements and a per-tensor fp32 scale (Blackwell). The planner prices all five; the trainer runs bf16
# and fp8 (RUNTIME_PRECISIONS).
Precision = Literal["bf16", "fp8", "fp8_tensorwise", "mxfp8", "nvfp4"]
RUNTIME_PRECISIONS = ("bf16", "fp8")
# host (CPU) time the planner charges (moestack/planner/host_profile.py): moestack's trainer eager or with compiled
# blocks (TrainSpec.compile blocks, which a plan priced on it runs; Calibration.host_modes, measured by `moestack tune
# --measure-host`), or a published framework's run it is validated against (Megatron-LM / Megatron-Bridge without CUDA
# graphs, with per-module graphs, with the whole iteration captured). No blocks+graphs: CUDA graphs need one device
# without FSDP2, and a plan always runs under FSDP2 (moestack/parallel/compile.py).
HostProfileName = Literal["eager", "blocks", "megatron", "megatron-graphs", "megatron-full-graphs"]
MOESTACK_HOST_PROFILES = ("eager", "blocks")  # the trainer's own; the rest price other frameworks' runs
Schedule = Literal["1f1b", "interleaved_1f1b", "zbv", "dualpipev", "gpipe"]
# chunks (virtual stages) each pipeline rank holds, per schedule; None = any vpp >= 2
SCHEDULE_VPP: dict[str, int | None] = {"1f1b": 1, "gpipe": 1, "interleaved_1f1b": None, "zbv": 2, "dualpipev": 2}
# V-shaped placement (rank r holds chunks r and 2p-1-r, so rank 0 has both ends) with split input / weight backward
V_SHAPE = ("zbv", "dualpipev")


class RecomputePolicy(StrictModel):
    """Activation recompute per layer part.

    none: keep every activation autograd saves. selective: recompute the cheap, memory-heavy pieces (norms,
    activation functions, gates, MLA up-projections, KDA short conv) and keep GEMM inputs. full: keep only the
    part's input and rerun its whole forward (including its communication) in backward.
    """

    kda: RecomputeMode = "none"
    attention: RecomputeMode = "none"  # full-attention mixers: gated MLA/DSA or GQA
    moe: RecomputeMode = "none"
    mlp: RecomputeMode = "none"  # dense MLP layers

    @classmethod
    def uniform(cls, mode: str) -> RecomputePolicy:
        return cls(kda=mode, attention=mode, moe=mode, mlp=mode)

    def short(self) -> str:
        modes = {self.kda, self.attention, self.moe, self.mlp}
        if len(modes) == 1:
            return modes.pop()
        abbrev = {"none": "-", "selective": "s", "full": "F"}
        return "kda{}/attn{}/moe{}/mlp{}".format(*(abbrev[m] for m in (self.kda, self.attention, self.moe, self.mlp)))


class OffloadPolicy(StrictModel):
    """What lives in host memory instead of HBM."""

    optimizer: bool = False  # optimizer states + fp32 master weights in host memory; the update runs on the CPU
    experts: bool = False  # routed-expert weights in host memory, streamed in per layer (prefetched)
    activations: bool = False  # saved activations copied to host after forward, back before backward

    def short(self) -> str:
        parts = [k for k in ("optimizer", "experts", "activations") if getattr(self, k)]
        return "+".join(parts) or "none"


class PlanPrediction(StrictModel):
    """What the cost model predicted for this plan (seconds, GiB, per device)."""

    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    memory_gib: dict[str, float]  # component -> GiB on the busiest device
    time_s: dict[str, float]  # component -> seconds per step (exposed time)
    binding: str  # the constraint that limits this plan


class Plan(StrictModel):
    model: str  # preset name, ModelSpec YAML or HF config.json
    cluster: str  # preset name or ClusterSpec YAML
    devices: int = Field(gt=0)
    seq_len: int = Field(gt=1)
    micro_batch_size: int = Field(default=1, gt=0)  # sequences per micro-batch per data-parallel rank
    global_batch_size: int = Field(gt=0)  # sequences per optimizer step
    # degrees
    pp: int = Field(default=1, gt=0)
    vpp: int = Field(default=1, gt=0)  # model chunks per pipeline rank
    dp_replicate: int = Field(default=1, gt=0)
    dp_shard: int = Field(default=1, gt=0)
    zero_stage: Literal[0, 1, 2, 3] = 0
    tp: int = Field(default=1, gt=0)
    cp: int = Field(default=1, gt=0)
    ep: int = Field(default=1, gt=0)
    etp: int = Field(default=1, gt=0)
    schedule: Schedule = "1f1b"
    recompute: RecomputePolicy = RecomputePolicy()
    offload: OffloadPolicy = OffloadPolicy()
    # fp8: the FP8 recipe (moestack/ops/fp8: experts and projections in e4m3, DeepSeek-V3's blockwise scales)
    precision: Precision = "bf16"
    optimizer: Literal["adamw", "adamw_bf16", "muon"] = "adamw"  # adamw_bf16: bf16 m, v; muon: momentum only
    dispatcher: Literal["flat", "hierarchical"] = "flat"  # MoE all-to-all: one flat a2a or two-level (dedup)
    # flat dispatcher transfer order: one all_to_all_single ("backend"), or point-to-point with the largest chunks
    # first, or in rotating rounds that avoid receiver hot spots (moestack/parallel/comm.py)
    ep_send_order: Literal["backend", "largest_first", "rotate"] = "backend"
    # context parallel KDA state: "relay" (rank to rank, ranks run each KDA layer in turn) or "scan" (every rank in
    # parallel, then an all-gather of the shards' state transitions; moestack/parallel/context.py)
    cp_kda: Literal["relay", "scan"] = "relay"
    # what the EP dispatch sends: "fp8" = rows quantised before the all-to-all (DeepEP, published DeepSeek-V3 runs);
    # the planner prices it, moestack's dispatcher sends bf16 only (moestack/config/support.py refuses fp8)
    ep_dispatch_dtype: Literal["bf16", "fp8"] = "bf16"
    # hierarchical dispatcher: each token crosses to a remote domain once (parallel/dedup.py)
    ep_token_dedup: bool = False
    # hierarchical dispatcher: EP ranks per fast domain; None = the cluster's innermost network tier, else the ranks
    # per node (LOCAL_WORLD_SIZE); must divide ep
    ep_domain_size: int | None = Field(default=None, gt=0)
    shared_expert_overlap: bool = False  # shared experts on a side CUDA stream, overlapped with EP dispatch/combine
    # TP collectives overlapped with the neighbouring GEMMs (Megatron's userbuffers); moestack runs them on the compute
    # stream, so only published runs' plans set it (the trainer refuses it: runtime_unsupported)
    tp_comm_overlap: bool = False
    # gradient sums over TP of replicated weights used on part of the work (routers, latent projections, norms, ...):
    # "eager" in every micro-batch's backward, "deferred" once per optimizer step, bucketed (parallel/tensor.py)
    tp_grad_reduce: Literal["eager", "deferred"] = "eager"
    # EP all-to-all hidden behind another micro-batch's compute: DualPipeV's overlapped forward / backward
    # (moestack/parallel/overlap_fb.py); other schedules refuse it (moestack/config/support.py)
    ep_comm_overlap: bool = False
    # planner inputs of published runs (tests/data/planner/published_runs.yaml); the trainer refuses values it does not
    # run (runtime_unsupported): TP without sequence parallelism (activations and norms whole on every TP rank,
    # all-reduces instead of all-gather / reduce-scatter), gradients kept and reduced in bf16 (Megatron
    # grad_reduce_in_fp32=False: an fp32 main-gradient shard in the optimizer instead), the FP8 / FP4 GEMM weights
    # stored in their GEMM format without a bf16 copy (Megatron fp8_param_gather / fp4_param_gather)
    sequence_parallel: bool = True
    # how layers are split into pipeline chunks: "balanced" (moestack: the slowest chunk as short as possible, the
    # embedding and LM head counted), "uniform" (Megatron's default: equal layer counts), "uniform_account" (Megatron
    # with account_for_embedding / loss_in_pipeline_split: the embedding and the loss take one layer's slot each)
    pipeline_split: Literal["balanced", "uniform", "uniform_account"] = "balanced"
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    quantized_params: bool = False
    # the MLP / expert activation function's input saved in FP8 for backward (Megatron activation_func_fp8_input_store;
    # DeepSeek-V3 report Sec. 3.3.3: SwiGLU inputs cached in FP8); with a low-precision recipe
    fp8_activation_input: bool = False
    # busiest EP rank's routed rows / the mean, per micro-batch: the dropless all-to-all and expert GEMMs wait for it.
    # 1.1: DeepSeek-V3's auxiliary-loss-free balancing (report Fig. 9, near-uniform loads); 1.0: forced balance (a
    # benchmark setting, Megatron moe_router_force_load_balancing). A forecast of the data's routing without
    # hot-expert replication (which lowers it, planner/eplb.py); the trainer's load telemetry warns when the measured
    # ratio (metrics.jsonl train/load/worst_rank_max_mean) exceeds it. A capacity factor (ModelSpec
    # moe.capacity_factor, token dropping) caps it
    moe_load_imbalance: float = Field(default=1.1, ge=1.0)
    # hot-expert replication (moestack/parallel/replicate.py): replica slots per EP rank and MoE layer, filled with
    # copies of the hottest experts, re-planned from the measured load every ep_replan_every steps; 0 = off
    ep_replicas: int = Field(default=0, ge=0)
    ep_replan_every: int = Field(default=50, gt=0)
    host_profile: HostProfileName = "eager"
    kernels: KernelSpec = KernelSpec()  # kernel choices; a TrainSpec's explicit ones win (config/kernel_spec.py)
    predicted: PlanPrediction | None = None

    @model_validator(mode="after")
    def _check(self) -> Plan:
        attn = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if attn != self.devices:
            raise ValueError(
                f"pp*dp_replicate*dp_shard*cp*tp = {self.pp}*{self.dp_replicate}*{self.dp_shard}*{self.cp}*{self.tp}"
                f" = {attn} must equal devices ({self.devices})"
            )
        inner = self.devices // self.pp
        if inner % (self.ep * self.etp):
            raise ValueError(f"ep*etp ({self.ep}*{self.etp}) must divide devices/pp ({inner})")
        if self.ep_domain_size is not None and self.ep % self.ep_domain_size:
            raise ValueError(f"ep_domain_size ({self.ep_domain_size}) must divide ep ({self.ep})")
        if self.zero_stage == 0 and self.dp_shard > 1:
            raise ValueError(f"zero_stage 0 with dp_shard {self.dp_shard}: plain replicas go in dp_replicate")
        if self.zero_stage > 0 and self.dp_shard == 1 and self.dp > 1:
            raise ValueError(f"zero_stage {self.zero_stage} needs dp_shard > 1 to shard anything")
        want_vpp = SCHEDULE_VPP[self.schedule]
        if self.pp == 1 and (self.schedule != "1f1b" or self.vpp != 1):
            raise ValueError(f"pp is 1: use schedule '1f1b' with vpp 1 (got {self.schedule}, vpp {self.vpp})")
        if want_vpp is None and self.vpp < 2:
            raise ValueError(f"schedule {self.schedule} needs vpp >= 2 (got {self.vpp})")
        if want_vpp is not None and self.vpp != want_vpp:
            raise ValueError(f"schedule {self.schedule} needs vpp == {want_vpp} (got {self.vpp})")
        per_step = self.micro_batch_size * self.dp
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of micro_batch_size*dp"
                f" ({self.micro_batch_size}*{self.dp} = {per_step})"
            )
        if self.pp > 1 and self.num_microbatches < self.pp:
            raise ValueError(
                f"{self.num_microbatches} micro-batches per step cannot fill {self.pp} pipeline stages"
                " (raise global_batch_size or lower micro_batch_size)"
            )
        if self.schedule == "interleaved_1f1b" and self.num_microbatches % self.pp:
            raise ValueError(
                f"interleaved_1f1b needs micro-batches per step ({self.num_microbatches}) divisible by pp ({self.pp})"
            )
        if self.seq_len % (2 * self.cp if self.cp > 1 else 1):
            raise ValueError(f"seq_len ({self.seq_len}) must be divisible by 2*cp ({2 * self.cp}) for balanced CP")
        if self.ep_replicas and (self.ep == 1 or self.etp > 1 or self.ep_token_dedup):
            raise ValueError(f"ep_replicas {self.ep_replicas} needs ep > 1 with etp 1 and ep_token_dedup off "
                             f"(got ep {self.ep}, etp {self.etp}, ep_token_dedup {self.ep_token_dedup})")
        if self.seq_len % (self.tp * self.cp):
            raise ValueError(f"seq_len ({self.seq_len}) must be divisible by tp*cp ({self.tp * self.cp})")
        return self

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        """Data-parallel degree of the routed experts (devices per pp stage not used by ep*etp)."""
        return self.devices // (self.pp * self.ep * self.etp)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def short(self) -> str:
        """One-line summary used in tables."""
        dp = f"dp{self.dp_replicate}x{self.dp_shard}z{self.zero_stage}" if self.dp_shard > 1 else f"dp{self.dp}"
        parts = [f"tp{self.tp}", f"cp{self.cp}", f"pp{self.pp}"]
        if self.vpp > 1:
            parts.append(f"v{self.vpp}")
        parts += [dp, f"ep{self.ep}"]
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        return " ".join(parts)


def runtime_unsupported(plan: Plan) -> list[str]:
    """Plan fields the trainer cannot honour (a plan priced for another framework's run); each a one-line reason."""
    out = []
    if plan.precision not in RUNTIME_PRECISIONS:
        out.append(f"precision {plan.precision} (the trainer runs {' and '.join(RUNTIME_PRECISIONS)})")
    if not plan.sequence_parallel and plan.tp > 1:
        out.append("sequence_parallel false (moestack's tensor parallelism is always sequence-parallel)")
    if plan.pipeline_split != "balanced" and plan.pp > 1:
        out.append(f"pipeline_split {plan.pipeline_split} (moestack balances the stages by cost)")
    if plan.grad_dtype != "fp32":
        out.append(f"grad_dtype {plan.grad_dtype} (FSDP2 keeps fp32 gradients)")
    if plan.fp8_activation_input:
        out.append("fp8_activation_input (moestack saves the activation inputs in bf16)")
    if plan.quantized_params:
        out.append("quantized_params (the trainer keeps bf16 / fp32 parameters)")
    if plan.tp_comm_overlap and plan.tp > 1:
        out.append("tp_comm_overlap (moestack's TP collectives run on the compute stream)")
    if plan.host_profile not in MOESTACK_HOST_PROFILES:
        out.append(f"host_profile {plan.host_profile} (priced for another framework's host; re-plan with the "
                   "default eager profile)")
    return out


def load_plan(path: str | Path) -> Plan:
    """Read a Plan YAML (as written by `moestack plan`)."""
    return validate(Plan, read_yaml(path), str(path))


def save_plan(plan: Plan, path: str | Path) -> None:
    dump_yaml(plan, path)


def make_plan(**fields) -> Plan:
    """Build a Plan from keyword fields, raising a one-line ConfigError on a bad combination."""
    return validate(Plan, fields, "plan")


__all__ = [
    "ConfigError",
    "OffloadPolicy",
    "Plan",
    "PlanPrediction",
    "RecomputePolicy",
    "load_plan",
    "make_plan",
    "runtime_unsupported",
    "save_plan",
]
