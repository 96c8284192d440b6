"""`parallelize(model, plan, meshes)`: the one place a built model becomes a parallel one, in a fixed order.

    0. precision: plan.precision fp8 converts the experts' GEMMs and the projections (moestack/ops/fp8/convert.py)
    1. expert parallelism (expert.py), then tensor parallelism (DTensor plans, moestack.parallel.tensor), which
       leaves the already-EP-sharded expert weights alone and runs each MoE on its rank's own tokens, or context
       parallelism (context.py: sequence split, KDA state relay, gathered MLA latent)
    2. memory policies: activation recompute / offload (moestack.memory.apply)
    3. compile: regional torch.compile of the blocks (TrainSpec.compile, compile.py), when the caller passes one
    4. FSDP2 / ZeRO (fsdp.py), last, so it shards the already TP/EP-sharded parameters

The order matters (torchtitan's rule): recompute wraps modules whose TP/EP layout is final, and FSDP must see the
final module tree and DTensor parameters. Pipeline splitting happens before this, per stage
(moestack.parallel.pipeline); `model` may be a whole Transformer or one stage's chunk.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
from torch import nn

from moestack.config.base import ConfigError
from moestack.config.plan import Plan
from moestack.model.moe import MoE
from moestack.parallel.compile import CompiledBlocks
from moestack.parallel.context import apply_cp
from moestack.parallel.dedup import apply_token_dedup
from moestack.parallel.expert import apply_expert_parallel, make_dispatcher
from moestack.parallel.fsdp import apply_fsdp, mixed_precision
from moestack.parallel.mesh import Meshes
from moestack.parallel.overlap import apply_shared_expert_overlap
from moestack.parallel.tensor import apply_tp


def _optional(module: str, what: str, field: str):
    """Import a module another part of moestack provides, or fail with one line naming what is missing."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"plan.{field}: {what} needs {module}, which is not in this build; turn it off in the plan")
    return importlib.import_module(module)


def _needs_memory_policies(plan: Plan) -> bool:
    modes = {plan.recompute.kda, plan.recompute.attention, plan.recompute.moe, plan.recompute.mlp}
    # (optimizer offload is the optimizer's business: moestack.train.optimizers)
    return modes != {"none"} or plan.offload.experts or plan.offload.activations or plan.precision == "fp8"


def parallelize(model: nn.Module, plan: Plan, meshes: Meshes, param_dtype: torch.dtype | None = None,
                compiled: CompiledBlocks | None = None) -> nn.Module:
    """Apply precision -> EP -> TP -> memory policies -> compile -> FSDP to `model` in place (as `plan` and `meshes`
    say); returns it. compiled: the run's compile choice (resolve_compile with sharded=True), None = eager.

    param_dtype: the dtype FSDP gathers parameters in for compute (torch.bfloat16 for bf16 training on GPUs;
    None keeps fp32, the CPU / exact-comparison setting). Gradients reduce in fp32 (in the parameters' dtype when
    param_dtype is None: fp64 models reduce in fp64); master weights stay fp32.
    """
    for module in model.modules():  # the global-batch balance loss counts load over every rank of the stage
        if isinstance(module, MoE):
            module.balance_group = meshes.stage_group
    if plan.precision == "fp8":
        from moestack.ops.fp8.convert import convert_precision

        p = next(model.parameters(), None)
        device = p.device if p is not None and p.device.type != "meta" else \
            torch.device("cuda" if torch.cuda.is_available() else "cpu")
        convert_precision(model, plan.precision, device, plan.kernels.fp8)
    expert_sharded = plan.ep > 1 or plan.etp > 1
    if expert_sharded:
        groups = meshes.ep_domain_groups() if plan.dispatcher == "hierarchical" else None
        ep_etp = meshes.experts["ep", "etp"] if plan.etp > 1 else None
        kind = "hierarchical_dedup" if plan.dispatcher == "hierarchical" and plan.ep_token_dedup else plan.dispatcher
        dispatcher = make_dispatcher(kind, meshes.ep, groups, plan.ep_send_order)
        dispatcher.overlap = plan.ep_comm_overlap  # hand-over points for DualPipeV's overlapped F / B
        apply_expert_parallel(model, meshes.ep, dispatcher, ep_etp)
        if kind == "hierarchical_dedup":
            apply_token_dedup(model)
        if plan.ep_replicas:
            from moestack.parallel.replicate import apply_replication

            apply_replication(model, meshes.ep.get_group(), plan.ep_replicas)
    if plan.shared_expert_overlap:  # before TP: TP's unit swap must wrap it (the launch reads the shared weights)
        apply_shared_expert_overlap(model)
    if plan.tp > 1:
        apply_tp(model, meshes.tp, sequence_parallel=True, grad_reduce=plan.tp_grad_reduce)
    if plan.cp > 1:
        apply_cp(model, meshes.cp, seq_shard_group=meshes.seq_group if plan.tp > 1 else None, kda_state=plan.cp_kda)
    if _needs_memory_policies(plan):
        if plan.offload.experts and plan.devices > 1:
            raise ConfigError("plan.offload.experts: expert offload with more than one device is not supported yet "
                              "(FSDP / EP would have to leave the host-resident expert weights alone)")
        memory = _optional("moestack.memory.apply", "recompute / offload / fp8", "recompute")
        memory.apply_memory_policies(model, plan)
    if compiled is not None:
        compiled.apply(model)
    # FSDP2 over the data-parallel ranks (also for zero_stage 0: a replicate-only mesh gives plain DDP semantics)
    apply_fsdp(
        model,
        meshes.dp_cp,
        plan.zero_stage,
        # gradients reduce in fp32 under bf16 compute; in the parameters' dtype otherwise (fp64 stays fp64)
        mixed_precision(param_dtype, torch.float32 if param_dtype is not None else None),
        expert_mesh=meshes.edp if expert_sharded else None,
        expert_grad_divide=plan.dp if expert_sharded else None,
        dense_grad_divide=plan.dp if plan.cp > 1 else None,  # CP shares add up; only the dp replicas average
    )
    return model
