"""What pricing one sub-layer needs (Ctx: the plan, model, cluster, calibration and tokens per micro-batch) and what
it returns (PartCost: seconds and bytes of one sub-layer, one micro-batch, one device)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moestack.config.cluster import ClusterSpec
from moestack.config.model_spec import ModelSpec
from moestack.config.plan import Plan
from moestack.planner.calibration import Calibration


@dataclass
class Ctx:
    """Everything a part's cost needs besides the part itself."""

    plan: Plan
    spec: ModelSpec
    cluster: ClusterSpec
    cal: Calibration
    tokens: float  # T: tokens per micro-batch on one device's TP group (mbs * seq / cp)

    @property
    def tokens_sp(self) -> float:  # sequence-parallel shard
        return self.tokens / self.plan.tp


@dataclass
class PartCost:
    """One sub-layer, one micro-batch, one device. Seconds and bytes."""

    fwd: float = 0.0  # forward compute + exposed forward communication (EP a2a excluded: see a2a)
    bwd: float = 0.0  # backward compute + exposed backward communication (no recompute)
    wgrad: float = 0.0  # weight-gradient GEMMs inside bwd (zero-bubble schedules defer them)
    recompute: float = 0.0  # forward work redone in backward
    a2a: float = 0.0  # EP all-to-all (+ ETP gathers) of fwd, bwd and recompute, before overlap
    act: float = 0.0  # saved activation bytes
    act_kept: float = 0.0  # of which activation offload leaves on the device (autocast copies of weights)
    parts: dict[str, float] = field(default_factory=dict)  # component -> seconds (compute and exposed comm)

    def add(self, other: PartCost, times: float = 1.0, breakdown: bool = True) -> None:
        self.fwd += other.fwd * times
        self.bwd += other.bwd * times
        self.wgrad += other.wgrad * times
        self.recompute += other.recompute * times
        self.a2a += other.a2a * times
        self.act += other.act * times
        self.act_kept += other.act_kept * times
        if not breakdown:
            return
        for key, val in other.parts.items():
            self.parts[key] = self.parts.get(key, 0.0) + val * times

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.recompute
