"""apply_memory_policies: the Plan's recompute / offload / FP8-storage choices applied to a built model.

Called by parallelize() after TP/EP and before FSDP (torchtitan order: TP/EP -> recompute -> compile -> FSDP), on a
materialised model (expert offload moves weights to host memory; a later `.to()` / `to_empty()` would undo it).
The optimizer half of the offload policy is the optimizer's business:
`moestack.train.optimizers.build_optimizer_from_name(model, plan.optimizer, spec, offload=plan.offload.optimizer)`.
With expert offload, FSDP must leave `Experts.w_gate_up` / `w_down` alone (they are host tensors whose gradients
are written by ExpertOffload, not by autograd's accumulation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moestack.config.plan import Plan
from moestack.memory.offload import ActivationOffloader, ExpertOffload, apply_activation_offload, apply_expert_offload
from moestack.memory.precision import enable_fp8_expert_inputs
from moestack.memory.recompute import apply_recompute


@dataclass
class MemoryPolicies:
    """What apply_memory_policies did (kept on the model as `model.memory_policies`)."""

    recompute: dict[str, str]  # wrapped module name -> mode
    activation_offload: ActivationOffloader | None
    expert_offload: ExpertOffload | None
    fp8_expert_inputs: bool

    def summary(self) -> str:
        modes = sorted(set(self.recompute.values())) or ["none"]
        parts = [f"recompute {'/'.join(modes)} on {len(self.recompute)} modules"]
        if self.activation_offload is not None:
            parts.append("activation offload")
        if self.expert_offload is not None:
            parts.append("expert offload")
        if self.fp8_expert_inputs:
            parts.append("fp8 saved expert inputs")
        return ", ".join(parts)


def _compute_device(model: nn.Module) -> torch.device:
    device = next(model.parameters()).device
    if device.type == "meta":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device


def apply_memory_policies(model: nn.Module, plan: Plan, device: torch.device | str | None = None) -> None:
    """Apply plan.recompute, plan.offload.experts / activations and (plan.precision "fp8") FP8 storage of the
    expert GEMMs' saved inputs to `model` (a Transformer or a pipeline stage of one) in place. The storage is for
    experts on a bf16 strategy: the FP8 recipe (moestack/ops/fp8/convert.py) puts them on the FP8 GEMMs, which save
    their inputs in FP8 themselves.

    Order: recompute wrapping first (checkpointed parts keep their own saved-tensor hooks), FP8 storage and expert
    offload on the expert GEMM seam, activation offload around each Block last. `device`: where the model computes
    (default: where its parameters are; cuda / cpu for a meta model). Afterwards `model.memory_policies` holds a
    MemoryPolicies with the offloaders (their `stats`).
    """
    if getattr(model, "memory_policies", None) is not None:
        raise RuntimeError("apply_memory_policies was already applied to this model")
    device = torch.device(device) if device is not None else _compute_device(model)
    wrapped = apply_recompute(model, plan.recompute)
    fp8 = plan.precision == "fp8"
    if fp8:
        for moe in model.moe_layers().values():
            if not getattr(moe.experts.gemm, "saves_fp8_inputs", False):  # the FP8 recipe's GEMMs do it themselves
                enable_fp8_expert_inputs(moe.experts)
    experts = None
    if plan.offload.experts:
        transfer = torch.bfloat16 if device.type == "cuda" else None  # the GEMMs run in bf16 under autocast
        experts = apply_expert_offload(model, device, transfer)
    activations = apply_activation_offload(model, device) if plan.offload.activations else None
    model.memory_policies = MemoryPolicies(wrapped, activations, experts, fp8)
