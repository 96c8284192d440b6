"""The one precision converter: `precision: fp8` applied to a built model from outside, at build time.

parallelize() calls it first (plan.precision fp8), the trainer's single-device build likewise (TrainSpec.precision
fp8). What runs in e4m3 with DeepSeek-V3's fine-grained scales (1x128 activation tiles, 128x128 weight blocks, fp32
accumulation; forward, dX and dW):
    routed experts   their GEMM strategy (`Experts.gemm`) becomes grouped_gemm.Fp8GroupedGemm
    Linear layers    every projection the planner's cost model prices in FP8 (moestack/planner/cost/work.py, Gemm.fp8):
                     KDA q / k / v / f / g / o, MLA q_a / q_b / q / kv_a / kv_b / g / o, GQA q / k / v / g / o,
                     dense and shared-expert GLU MLPs, LatentMoE down / up (linear.Fp8Linear)
What stays bf16 (as in DeepSeek-V3 and the cost model): embedding, LM head, MoE router, DSA lightning indexer, KDA's
beta and low-rank gate projections, attention and recurrence cores, norms; and a Linear with a bias (Fp8Linear has
none), which the report names. Modules are found by class name (FP8_LINEARS; an `experts` attribute with a `gemm`
strategy), so this module needs nothing from the model package.

The conversions keep every Parameter object, so optimizer state, FSDP2, tensor parallelism (its units swap in the
local shards before the Linear's forward), checkpoints and state_dict keys are unchanged. The experts' FP8 strategy
stores the inputs backward needs in FP8 itself, so the plan's FP8 activation storage (moestack/memory/precision.py)
is not added on top (memory/apply.py checks `saves_fp8_inputs`).

Needs an FP8 GPU (sm_89 or newer; the per-expert cuBLAS path sm_90) or, for a slow CPU check of the logic,
TRITON_INTERPRET=1; anything else is a ConfigError naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moestack.config.base import ConfigError
from moestack.config.kernel_spec import FP8Kernels
from moestack.ops.fp8 import fp8_unavailable_reason
from moestack.ops.fp8.reference import FP8

# per module class: its Linear attributes that run in FP8 (the cost model's fp8 GEMMs); the others stay bf16
FP8_LINEARS: dict[str, tuple[str, ...]] = {
    "KDAAttention": ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj", "o_proj"),
    "GatedMLA": ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj", "kv_b_proj", "g_proj", "o_proj"),
    "GQAAttention": ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj"),
    "GLUMLP": ("gate_proj", "up_proj", "down_proj"),
    "MoE": ("down_proj", "up_proj"),
}


@dataclass
class Fp8Report:
    moe_layers: int = 0  # MoE layers whose routed experts run the FP8 GEMMs
    linears: list[str] = field(default_factory=list)  # qualified names converted to Fp8Linear
    kept_bf16: list[str] = field(default_factory=list)  # listed projections left in bf16, with the reason

    def summary(self) -> str:
        text = (f"FP8 recipe: routed experts of {self.moe_layers} MoE layers in FP8, {len(self.linears)} Linear "
                f"layers in FP8 (1x128 / 128x128 scales); bf16: embedding, LM head, routers, DSA indexers, KDA beta / "
                f"low-rank gates")
        return text + (f"; also bf16: {', '.join(self.kept_bf16)}" if self.kept_bf16 else "")


def fp8_linear_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names of the Linear layers the recipe converts, "name (reason)" of listed ones it leaves in bf16)."""
    chosen, kept = [], []
    for prefix, module in model.named_modules():
        for attr in FP8_LINEARS.get(type(module).__name__, ()):
            linear = getattr(module, attr, None)
            if linear is None:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            if not isinstance(linear, nn.Linear):
                kept.append(f"{name} (a {type(linear).__name__}, not a Linear)")
            elif linear.bias is not None:
                kept.append(f"{name} (has a bias)")
            else:
                chosen.append(name)
    return chosen, kept


def apply_fp8_recipe(model: nn.Module, device: torch.device, kernels: FP8Kernels | None = None,
                     q_dtype: torch.dtype = FP8) -> Fp8Report:
    """Put `model` (a Transformer or a pipeline stage of one, before any other parallelism) on the FP8 recipe in
    place, with KernelSpec.fp8's choices. q_dtype float32: the interpreter tests' unrounded mode (no global state)."""
    from moestack.ops.fp8.grouped_gemm import Fp8GroupedGemm
    from moestack.ops.fp8.linear import convert_to_fp8_linear

    reason = fp8_unavailable_reason(device)
    if reason is not None:
        raise ConfigError(f"precision: fp8 cannot run here: {reason}; use precision bf16")
    kernels = kernels or FP8Kernels()
    report = Fp8Report()
    for module in model.modules():
        if type(module).__name__ == "MoE" and hasattr(module.experts, "gemm"):
            module.experts.gemm = Fp8GroupedGemm(kernels.weight_cache, kernels.cublas_min_rows, q_dtype)
            report.moe_layers += 1
    report.linears, report.kept_bf16 = fp8_linear_names(model)
    convert_to_fp8_linear(model, report.linears, q_dtype, kernels.cublas_min_rows, kernels.weight_cache)
    return report


def convert_precision(model: nn.Module, precision: str, device: torch.device,
                      kernels: FP8Kernels | None = None) -> Fp8Report | None:
    """The build step's precision converter: the FP8 recipe for precision "fp8" (its report, also kept as
    model.fp8_report), nothing for the others (bf16 / fp32 / auto are autocast's business)."""
    if precision != "fp8":
        return None
    report = apply_fp8_recipe(model, device, kernels)
    model.fp8_report = report
    return report
