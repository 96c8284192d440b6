"""`parallelize(model, plan, meshes)`: the one place a built model becomes a parallel one, in a fixed order.

    1. tensor parallelism (DTensor plans, moestack.parallel.tensor) and expert parallelism (expert.py)
    2. memory policies: activation recompute / offload (moestack.memory.apply)
    3. compile: not applied here yet (the plan has no compile switch)
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
from moestack.parallel.expert import apply_expert_parallel, make_dispatcher
from moestack.parallel.fsdp import apply_fsdp, mixed_precision
from moestack.parallel.mesh import Meshes


def _optional(module: str, what: str, degree: str):
    """Import a module another part of moestack provides, or fail with one line naming what is missing."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"plan.{degree}: {what} needs {module}, which is not in this build; set {degree} to the "
                          "trivial value")
    return importlib.import_module(module)


def _needs_memory_policies(plan: Plan) -> bool:
    modes = {plan.recompute.kda, plan.recompute.attention, plan.recompute.moe, plan.recompute.mlp}
    return modes != {"none"} or plan.offload.short() != "none" or plan.precision == "fp8"


def parallelize(model: nn.Module, plan: Plan, meshes: Meshes, param_dtype: torch.dtype | None = None) -> nn.Module:
    """Apply TP/EP -> memory policies -> FSDP to `model` in place (as `plan` and `meshes` say); returns it.

    param_dtype: the dtype FSDP gathers parameters in for compute (torch.bfloat16 for bf16 training on GPUs;
    None keeps fp32, the CPU / exact-comparison setting). Gradients reduce in fp32; master weights stay fp32.
    """
    if plan.tp > 1:
        tensor = _optional("moestack.parallel.tensor", "tensor parallelism", "tp")
        tensor.apply_tp(model, meshes.tp, sequence_parallel=True)
    if plan.ep > 1:
        groups = meshes.ep_domain_groups() if plan.dispatcher == "hierarchical" else None
        apply_expert_parallel(model, meshes.ep, make_dispatcher(plan.dispatcher, meshes.ep, groups))
    if _needs_memory_policies(plan):
        memory = _optional("moestack.memory.apply", "recompute / offload / fp8", "recompute")
        memory.apply_memory_policies(model, plan)
    # FSDP2 over the data-parallel ranks (also for zero_stage 0: a replicate-only mesh gives plain DDP semantics)
    apply_fsdp(
        model,
        meshes.dp,
        plan.zero_stage,
        mixed_precision(param_dtype),
        expert_mesh=meshes.edp if plan.ep > 1 else None,
        expert_grad_divide=plan.dp if plan.ep > 1 else None,
    )
    return model
