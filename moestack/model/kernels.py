"""The build step's kernel choices: a KernelSpec resolved for the device (moestack/ops/backends.py) and set on the
modules that call the ops, so the model runs exactly what the run directory's kernels.json records.

    KDAAttention.kda_backend, .layer_ops    kda.backend, kda.layer_ops
    GatedMLA.dsa_backend                    dsa.backend
    MoE.routing_backend (router, experts)   moe.routing
    Router.solve_graph                      moe.solve_graph
    Experts.gemm (the bf16 strategy)        moe.gemm, moe.crossover (the FP8 recipe's strategy is left alone)
"""

from __future__ import annotations

import torch
from torch import nn

from moestack.config.kernel_spec import KernelSpec
from moestack.ops.backends import ResolvedKernels, resolve_kernels


def _none_if_auto(name: str) -> str | None:
    return None if name == "auto" else name


def apply_kernels(model: nn.Module, kernels: KernelSpec | ResolvedKernels | None,
                  device: torch.device | str | None = None) -> ResolvedKernels:
    """Set every op-calling module of `model` (a Transformer, a stage or one layer) to the resolved choices.
    A KernelSpec (or None = all auto) is resolved first for `device` (default: where the parameters are; cuda /
    cpu for a meta model). Returns the resolution (for kernels.json)."""
    from moestack.model.dsa import GatedMLA
    from moestack.model.kda import KDAAttention
    from moestack.model.moe import MoE
    from moestack.ops.moe import GroupedGemm
    from moestack.ops.moe.gemm_select import load_table

    if not isinstance(kernels, ResolvedKernels):
        if device is None:
            p = next(model.parameters(), None)
            device = p.device if p is not None and p.device.type != "meta" else \
                torch.device("cuda" if torch.cuda.is_available() else "cpu")
        kernels = resolve_kernels(kernels, device)
    spec = kernels.spec
    table = load_table(spec.moe.crossover) if spec.moe.crossover is not None else None
    for module in model.modules():
        if isinstance(module, KDAAttention):
            module.kda_backend, module.layer_ops = spec.kda.backend, spec.kda.layer_ops
        elif isinstance(module, GatedMLA):
            module.dsa_backend = spec.dsa.backend
        elif isinstance(module, MoE):
            module.routing_backend = _none_if_auto(spec.moe.routing)
            module.router.solve_graph = spec.moe.solve_graph
            if type(module.experts.gemm) is GroupedGemm:  # not the FP8 recipe's, not wrapped by the offload
                module.experts.gemm = GroupedGemm(spec.moe.gemm, table)
    return kernels
