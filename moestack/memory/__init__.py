"""Memory policies applied to a built model from outside (the model code has none of this).

    recompute.py   activation recompute per layer part: none / selective (torch SAC policy) / full (checkpoint)
    offload.py     saved activations to pinned host memory (prefetched back); routed-expert weights in host memory,
                   only the experts with tokens fetched per GEMM (the Experts.grouped_mm seam)
    precision.py   FP8 (e4m3, per-row scales) storage of the expert GEMMs' saved inputs
    apply.py       apply_memory_policies(model, plan): the Plan's choices, called by parallelize()
    report.py      the memory report (`moestack train --memory-report`) next to the planner's prediction;
                   phase_peaks.py: the peak per phase of one step
    adamw.py       AdamW with bf16 states (stochastic rounding) and CPU-offloaded AdamW; host_adamw.py: their fast
                   host kernels. Muon and building an optimizer by name: moestack/train/optimizers.py.
    compute_weights.py  bf16 weight copies cast once per optimizer step (TrainSpec.weight_cache)
"""

from __future__ import annotations

from moestack.memory.apply import MemoryPolicies, apply_memory_policies
from moestack.memory.offload import (
    ActivationOffloader,
    ExpertOffload,
    apply_activation_offload,
    apply_expert_offload,
)
from moestack.memory.precision import enable_fp8_expert_inputs
from moestack.memory.recompute import apply_recompute, checkpoint_module, register_save_op, remove_recompute
from moestack.memory.report import MemoryReport, format_report, measure_memory, predicted_memory

__all__ = [
    "ActivationOffloader",
    "ExpertOffload",
    "MemoryPolicies",
    "MemoryReport",
    "apply_activation_offload",
    "apply_expert_offload",
    "apply_memory_policies",
    "apply_recompute",
    "checkpoint_module",
    "enable_fp8_expert_inputs",
    "format_report",
    "measure_memory",
    "predicted_memory",
    "register_save_op",
    "remove_recompute",
]
