"""Hot-expert replication under expert parallelism (EPLB / MoonEP style), applied on top of apply_expert_parallel.

Every EP rank keeps its X owned experts and gets S replica slots per MoE layer. A plan (moestack.planner.eplb,
from measured tokens per expert) fills the slots with copies of the hottest experts on the least loaded ranks; the
tokens of an expert with n copies are split evenly over them. The layer then works on P * (X + S) "physical"
experts: rank r's physical experts are its X owned ones followed by its S slots, and the existing dispatcher
(flat or hierarchical) moves rows to them unchanged.

Per forward, with a plan:
    1. split: each source rank cuts its rows of expert e into n_e contiguous chunks, one per copy (sizes differ by
       at most one; the source rank rotates which copies get the remainder), and orders all rows by physical
       expert (an index gather, no host sync)
    2. fetch: every rank receives the current weights of its replica slots from their owners (one all-to-all per
       weight tensor, comm.all_to_all); the copies are the owner's weights, so they are equal by construction
    3. the dispatcher runs the X + S local physical experts; rows go back and are un-permuted
Backward: the fetch's backward sends each copy's weight gradient back to its owner, where it adds into the owned
weight's gradient (index_select's backward): gradients summed over all copies, one optimizer update at the owner.
Replicas are neither parameters nor buffers: state dicts and checkpoints keep exactly the layout without
replication. A new plan can be installed at any step (`set_replica_plan`); it must be the same on every EP rank
(compute it from the all-reduced counts).

Legend: N rows (sorted by global expert), E experts, P EP ranks, X = E / P, S slots per rank, Q = P * (X + S)
physical experts, F flattened weight width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moestack.config.base import ConfigError
from moestack.model.moe import MoE
from moestack.parallel.comm import all_to_all
from moestack.parallel.expert import ExpertParallelExperts, FlatDispatcher, HierarchicalDispatcher, invert_index
from moestack.planner.eplb import plan_replicas


@dataclass
class ReplicaPlan:
    """One layer's replica placement (the same on every EP rank) and the index tensors derived from it.

    slot_expert: [P][<= S] global experts held in each rank's replica slots (unused slots are left out).
    """

    slot_expert: list[list[int]]
    num_experts: int
    ep: int
    slots: int
    device: torch.device

    def __post_init__(self) -> None:
        E, P, S = self.num_experts, self.ep, self.slots
        X = E // P
        assert all(len(s) <= S for s in self.slot_expert) and len(self.slot_expert) == P
        copies = [[e // X] for e in range(E)]  # ranks holding expert e, owner first, then replicas by rank
        phys = []  # (expert, copy index) of each physical expert, rank-major; (-1, 0) for an unused slot
        for r in range(P):
            phys += [(e, 0) for e in range(r * X, (r + 1) * X)]
            for e in self.slot_expert[r]:
                phys.append((e, len(copies[e])))
                copies[e].append(r)
            phys += [(-1, 0)] * (S - len(self.slot_expert[r]))
        self.copies = [len(c) for c in copies]
        dev = self.device
        self.phys_expert_Q = torch.tensor([e for e, _ in phys], dtype=torch.int64, device=dev)
        self.phys_copy_Q = torch.tensor([i for _, i in phys], dtype=torch.int64, device=dev)
        self.copies_E = torch.tensor(self.copies, dtype=torch.int64, device=dev)
        self.max_copies = max(self.copies)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep

    def physical_counts(self, counts_E: torch.Tensor, src: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows per physical expert [Q], their first row in the expert-sorted input [Q]) for source rank `src`
        whose rows per global expert are counts_E [E]."""
        used = self.phys_expert_Q >= 0
        e_Q = self.phys_expert_Q.clamp_min(0)
        c_Q = torch.where(used, counts_E[e_Q], 0)
        n_Q = self.copies_E[e_Q]
        base_Q, rem_Q = c_Q // n_Q, c_Q % n_Q
        i_Q = self.phys_copy_Q
        # copy j of an expert gets one extra row when (j - src) mod n < rem: the remainder rotates with the source
        j = torch.arange(self.max_copies, device=counts_E.device)
        extra_QJ = ((j[None, :] - src) % n_Q[:, None]) < rem_Q[:, None]
        size_Q = base_Q + extra_QJ.gather(1, i_Q[:, None]).squeeze(1).long()
        size_Q = torch.where(used, size_Q, 0)
        extra_before_Q = (extra_QJ & (j[None, :] < i_Q[:, None])).sum(1)
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        start_Q = torch.where(used, starts_E[e_Q] + i_Q * base_Q + extra_before_Q, 0)
        return size_Q, start_Q

    def rank_load(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Expected tokens per EP rank [P] (float) for global tokens per expert counts_E [E] under this plan."""
        used = self.phys_expert_Q >= 0
        e_Q = self.phys_expert_Q.clamp_min(0)
        share_Q = torch.where(used, counts_E.to(self.copies_E.device).double()[e_Q] / self.copies_E[e_Q], 0.0)
        return share_Q.view(self.ep, -1).sum(-1)


def _fetch_replicas(w_XF: torch.Tensor, plan: ReplicaPlan, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's replica-slot weights [S, F] (zeros in unused slots) fetched from their owners' w_XF [X, F]
    (each rank's owned experts, flattened). Differentiable: gradients go back to the owners' rows."""
    P, X, S = plan.ep, plan.experts_per_rank, plan.slots
    me = dist.get_rank(group)
    send_idx, in_splits = [], []
    for r in range(P):  # what I own of rank r's slots, in r's slot order
        mine = [e - me * X for e in plan.slot_expert[r] if e // X == me]
        send_idx += mine
        in_splits.append(len(mine))
    slots = plan.slot_expert[me]
    out_splits = [sum(1 for e in slots if e // X == o) for o in range(P)]
    idx = torch.tensor(send_idx, dtype=torch.int64, device=w_XF.device)
    recv = all_to_all(w_XF.index_select(0, idx), out_splits, in_splits, group)  # rows by owner, then slot order
    by_owner = sorted(range(len(slots)), key=lambda i: (slots[i] // X, i))  # slot of each received row
    order = torch.tensor(by_owner, dtype=torch.int64, device=w_XF.device)
    fetched = recv[invert_index(order)] if len(slots) else recv
    if len(slots) < S:
        fetched = torch.cat([fetched, fetched.new_zeros((S - len(slots), w_XF.shape[1]))])
    return fetched


class ReplicatedExperts(ExpertParallelExperts):
    """ExpertParallelExperts with replica slots (installed by `apply_replication`). Without a plan (before the
    first measurement) it runs exactly the parent's path."""

    replica_plan: ReplicaPlan | None = None
    replica_group: dist.ProcessGroup
    replica_slots: int = 0

    def forward(self, h_NL: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        plan = self.replica_plan
        if plan is None:
            return super().forward(h_NL, offs_E)
        offs = offs_E.long()
        counts_E = torch.diff(offs, prepend=offs.new_zeros(1))
        N = h_NL.shape[0]
        size_Q, start_Q = plan.physical_counts(counts_E, dist.get_rank(self.replica_group))
        slot_R = torch.repeat_interleave(torch.arange(size_Q.numel(), device=h_NL.device), size_Q, output_size=N)
        first_Q = torch.cumsum(size_Q, 0) - size_Q
        index_R = start_Q[slot_R] + torch.arange(N, device=h_NL.device) - first_Q[slot_R]
        y_RL = self.ep_dispatcher(h_NL[index_R], size_Q, self._physical_local_forward)
        return y_RL[invert_index(index_R)]

    def _physical_local_forward(self, x_RL: torch.Tensor, offs_X: torch.Tensor) -> torch.Tensor:
        """The X owned experts and the S fetched copies on rows sorted by local physical expert."""
        from moestack.parallel.expert import _local

        plan = self.replica_plan
        w_gu, w_dn = _local(self.w_gate_up), _local(self.w_down)
        X, S = w_gu.shape[0], plan.slots
        gu = _fetch_replicas(w_gu.reshape(X, -1), plan, self.replica_group).view(S, *w_gu.shape[1:])
        dn = _fetch_replicas(w_dn.reshape(X, -1), plan, self.replica_group).view(S, *w_dn.shape[1:])
        return self.ffn(x_RL, torch.cat([w_gu, gu]), torch.cat([w_dn, dn]), offs_X)


def apply_replication(model: nn.Module, ep_group: dist.ProcessGroup, slots: int) -> list[str]:
    """Give every EP MoE under `model` `slots` replica slots per rank (no plan yet: call `set_replica_plan`).
    Apply after apply_expert_parallel; flat and hierarchical dispatchers, no ETP, no token dedup."""
    if slots < 1:
        raise ConfigError(f"plan.ep_replicas: {slots} replica slots per rank; use >= 1 (0 turns replication off)")
    done = []
    for name, moe in model.named_modules():
        if not isinstance(moe, MoE) or not isinstance(moe.experts, ExpertParallelExperts):
            continue
        experts = moe.experts
        if experts.ep_etp_group is not None:
            raise ConfigError("plan.ep_replicas: hot-expert replication with expert tensor parallelism (etp > 1) is "
                              "not supported; set ep_replicas 0 or etp 1")
        if type(experts.ep_dispatcher) not in (FlatDispatcher, HierarchicalDispatcher):
            raise ConfigError("plan.ep_replicas: replication needs the flat or hierarchical dispatcher (not "
                              "ep_token_dedup)")
        experts.__class__ = ReplicatedExperts
        experts.replica_group, experts.replica_slots, experts.replica_plan = ep_group, slots, None
        done.append(name)
    return done


def replicated_layers(model: nn.Module) -> dict[str, ReplicatedExperts]:
    """The MoE layers with replication, keyed like Transformer.moe_layers()."""
    out = {}
    for name, moe in model.moe_layers().items() if hasattr(model, "moe_layers") else []:
        if isinstance(moe.experts, ReplicatedExperts):
            out[name] = moe.experts
    return out


def set_replica_plan(experts: ReplicatedExperts, load_E: torch.Tensor | list[float]) -> ReplicaPlan:
    """Plan this layer's replicas from measured tokens per expert (identical on every EP rank) and install it."""
    load = load_E.tolist() if isinstance(load_E, torch.Tensor) else list(load_E)
    P = dist.get_world_size(experts.replica_group)
    dev = experts.w_gate_up.device
    plan = ReplicaPlan(plan_replicas(load, P, experts.replica_slots), len(load), P, experts.replica_slots, dev)
    experts.replica_plan = plan
    return plan


class Replanner:
    """Re-plans every replicated layer from its measured load: after the first optimizer step, then every `every`
    steps from the tokens per expert summed since the last plan (the trainer's all-reduced counts, identical on
    every rank; one host read per replan)."""

    def __init__(self, layers: dict[str, ReplicatedExperts], every: int):
        self.layers, self.every = layers, every
        self.steps = 0
        self.window: dict[str, torch.Tensor] = {}

    def after_step(self, counts: dict[str, torch.Tensor]) -> bool:
        """Count this step's load; True when it installed new plans."""
        self.steps += 1
        for name in self.layers:
            if name in counts:
                c = counts[name].detach().to(torch.int64)
                self.window[name] = self.window[name] + c if name in self.window else c.clone()
        if self.steps != 1 and self.steps % self.every:
            return False
        for name, experts in self.layers.items():
            if name in self.window:
                set_replica_plan(experts, self.window[name].cpu())
        self.window = {}
        return True

    def rank_load(self, name: str, counts_E: torch.Tensor) -> torch.Tensor:
        """Expected tokens per EP rank [P] for counts_E under layer `name`'s current placement."""
        experts = self.layers.get(name)
        plan = experts.replica_plan if experts is not None else None
        if plan is None:
            P = dist.get_world_size(experts.replica_group) if experts is not None else 1
            return counts_E.view(P, -1).sum(-1).double()
        return plan.rank_load(counts_E)


__all__ = ["ReplicaPlan", "Replanner", "ReplicatedExperts", "apply_replication", "replicated_layers",
           "set_replica_plan"]
