"""Parallelism applied to a built model from outside, driven by a Plan (model code stays single-device).

`parallelize` (parallelize.py) is the one entry point for a model or pipeline stage; README.md has the file map,
the layout rules, launch commands and what is tested.
"""

from moestack.parallel.comm import all_reduce_mean, all_reduce_sum_, all_to_all, clip_grad_norm_, global_grad_norm
from moestack.parallel.expert import (
    ExpertParallelExperts,
    FlatDispatcher,
    HierarchicalDispatcher,
    apply_expert_parallel,
    domain_limited_routing,
    make_dispatcher,
)
from moestack.parallel.fsdp import apply_fsdp, mixed_precision, set_gradient_sync
from moestack.parallel.mesh import Meshes, build_meshes, check_supported, mesh_layout
from moestack.parallel.parallelize import parallelize

__all__ = [
    "ExpertParallelExperts",
    "FlatDispatcher",
    "HierarchicalDispatcher",
    "Meshes",
    "all_reduce_mean",
    "all_reduce_sum_",
    "all_to_all",
    "apply_expert_parallel",
    "apply_fsdp",
    "build_meshes",
    "check_supported",
    "clip_grad_norm_",
    "domain_limited_routing",
    "global_grad_norm",
    "make_dispatcher",
    "mesh_layout",
    "mixed_precision",
    "parallelize",
    "set_gradient_sync",
]
