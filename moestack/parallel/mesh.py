"""Device meshes from a Plan, with the expert view folded onto the same ranks ("parallel folding").

Two meshes cover the same `plan.devices` ranks:

    dense   ("pp", "dp_replicate", "dp_shard", "cp", "tp")   attention, dense MLPs, embeddings, router, shared experts
    experts ("pp", "edp", "ep", "etp")                       routed experts; edp = devices / (pp * ep * etp)

Both number ranks row-major (last dim fastest), so inside one pipeline stage the expert groups (ep) are blocks of
consecutive ranks: an EP group lands in one node / scale-up domain whenever ep <= ranks per domain. With
`ep_domain_size` set (hierarchical dispatch), a third view splits ep into ("ep_domain", "ep_local"): ranks of one
fast domain, and the ranks with the same local index in every domain.

`mesh_layout(plan)` is the pure rank arithmetic (testable without processes); `build_meshes` creates the
DeviceMeshes (collective: every rank calls it with the same arguments).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from moestack.config.base import ConfigError
from moestack.config.plan import Plan
from moestack.config.support import unsupported

DENSE_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_DIMS = ("pp", "edp", "ep", "etp")
HIER_DIMS = ("pp", "edp", "ep_domain", "ep_local", "etp")


@dataclass(frozen=True)
class MeshLayout:
    """Rank grids of the dense and expert meshes (int64 tensors of rank ids; pure arithmetic, no processes)."""

    dense: torch.Tensor  # [pp, dp_replicate, dp_shard, cp, tp]
    experts: torch.Tensor  # [pp, edp, ep, etp]
    hier: torch.Tensor | None  # [pp, edp, ep // domain, domain, etp] when a domain size is given


def mesh_layout(plan: Plan, ep_domain_size: int | None = None) -> MeshLayout:
    """The folded rank layout of `plan`. ep_domain_size (ranks of EP per fast domain) must divide plan.ep."""
    ranks = torch.arange(plan.devices)
    dense = ranks.view(plan.pp, plan.dp_replicate, plan.dp_shard, plan.cp, plan.tp)
    experts = ranks.view(plan.pp, plan.edp, plan.ep, plan.etp)
    hier = None
    if ep_domain_size is not None:
        if ep_domain_size <= 0 or plan.ep % ep_domain_size:
            raise ConfigError(f"ep_domain_size: {ep_domain_size} must divide ep ({plan.ep})")
        hier = ranks.view(plan.pp, plan.edp, plan.ep // ep_domain_size, ep_domain_size, plan.etp)
    return MeshLayout(dense, experts, hier)


@dataclass
class Meshes:
    """The DeviceMeshes of one run and the sub-meshes / groups the parallel code and the trainer use."""

    plan: Plan
    dense: DeviceMesh
    experts: DeviceMesh
    hier: DeviceMesh | None = None  # expert view with ep split into (ep_domain, ep_local)
    dp_group: dist.ProcessGroup | None = None  # ranks reading different data (set by build_meshes)
    # every rank of my pipeline stage: each routes different tokens (DP: other data; TP: its own token shard of the
    # MoE), so router load counts are summed over this group
    stage_group: dist.ProcessGroup | None = None

    @property
    def device_type(self) -> str:
        return self.dense.device_type

    @property
    def dp(self) -> DeviceMesh:
        """2-D (dp_replicate, dp_shard) mesh that FSDP2 shards dense parameters over (HSDP when both > 1)."""
        return self.dense["dp_replicate", "dp_shard"]

    @property
    def cp(self) -> DeviceMesh:
        return self.dense["cp"]

    @property
    def dp_cp(self) -> DeviceMesh:
        """2-D (dp_replicate, dp_shard x cp) mesh: FSDP2 shards dense parameters over the data-parallel AND context-
        parallel ranks (the CP ranks hold shares of one gradient, which its reduce-scatter adds up)."""
        if self.plan.cp == 1:
            return self.dp
        return self.dense["dp_replicate", "dp_shard_cp"]

    @property
    def seq_group(self) -> dist.ProcessGroup:
        """The ranks one sequence is split over (cp x tp with sequence parallelism): the MoE sequence aux loss sums
        its expert counts over it."""
        if self.plan.cp > 1 and self.plan.tp > 1:
            return self.dense["cp_tp"].get_group()
        return self.dense["cp" if self.plan.cp > 1 else "tp"].get_group()

    @property
    def tp(self) -> DeviceMesh:
        return self.dense["tp"]

    @property
    def pp(self) -> DeviceMesh:
        return self.dense["pp"]

    @property
    def ep(self) -> DeviceMesh:
        return self.experts["ep"]

    @property
    def edp(self) -> DeviceMesh:
        """The mesh FSDP2 shards routed-expert parameters over (the ranks holding the same experts)."""
        return self.experts["edp"]

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks that read different data (dp_replicate x dp_shard)."""
        dense = self.dense
        return dense.get_local_rank("dp_replicate") * self.plan.dp_shard + dense.get_local_rank("dp_shard")

    def pp_group(self) -> dist.ProcessGroup | None:
        return self.dense.get_group("pp") if self.plan.pp > 1 else None

    def ep_domain_groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """(ranks of my fast domain, ranks with my local index in every domain), for hierarchical dispatch."""
        assert self.hier is not None, "build_meshes was called without ep_domain_size"
        return self.hier.get_group("ep_local"), self.hier.get_group("ep_domain")


def check_supported(plan: Plan) -> None:
    """Degrees and features this build can run; a one-line ConfigError naming the missing piece otherwise (the
    list is moestack.config.support, which the planner's search also honours)."""
    reason = unsupported(plan)
    if reason is not None:
        raise ConfigError(reason)


def build_meshes(plan: Plan, device_type: str | None = None, ep_domain_size: int | None = None) -> Meshes:
    """DeviceMeshes for `plan` on the initialised default process group (its size must be plan.devices).

    device_type: "cuda" or "cpu" (default: cuda when available). ep_domain_size: EP ranks per fast domain for the
    hierarchical dispatcher (None: no hierarchical view).
    """
    if not dist.is_initialized():
        raise ConfigError("build_meshes: torch.distributed is not initialised (launch with torchrun)")
    world = dist.get_world_size()
    if world != plan.devices:
        raise ConfigError(f"plan.devices: the plan is for {plan.devices} devices but {world} ranks were launched; "
                          f"run torchrun with --nproc-per-node/--nnodes giving {plan.devices} ranks")
    check_supported(plan)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    layout = mesh_layout(plan, ep_domain_size)
    dense = DeviceMesh(device_type, layout.dense, mesh_dim_names=DENSE_DIMS)
    experts = DeviceMesh(device_type, layout.experts, mesh_dim_names=EXPERT_DIMS)
    hier = DeviceMesh(device_type, layout.hier, mesh_dim_names=HIER_DIMS) if layout.hier is not None else None
    # the data-parallel ranks (distinct tokens) as one group: loss means and router load counts reduce over it
    dp_group = dense["dp_replicate", "dp_shard"]._flatten("dp").get_group()
    if plan.cp > 1:
        dense["dp_shard", "cp"]._flatten("dp_shard_cp")  # the FSDP shard dim under CP (Meshes.dp_cp)
    if plan.cp > 1 and plan.tp > 1:
        dense["cp", "tp"]._flatten("cp_tp")  # the ranks sharing one sequence (Meshes.seq_group)
    stage_group = dense["dp_replicate", "dp_shard", "cp", "tp"]._flatten("stage").get_group()
    return Meshes(plan, dense, experts, hier, dp_group, stage_group)
