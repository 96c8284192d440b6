"""Hot-expert replication plans (EPLB-style), pure Python: which experts get extra copies on which EP ranks.

Layout: EP rank j owns the contiguous experts [j*X, (j+1)*X) (X = E / P, moestack.parallel.expert) and has S
replica slots per MoE layer. An expert with n copies (its owner plus n - 1 replicas) has its tokens split evenly
over them, so each copy carries load_e / n. The plan is greedy on the busiest rank: take the copy with the largest
share on it, place one more copy of that expert on the least loaded rank that has a free slot and no copy yet, as
long as that lowers the busiest rank's load (LPT-style; the owners never move, so checkpoints keep their layout).
moestack.parallel.replicate runs a plan; the cost model prices it (`replicated_imbalance`).

Legend: E experts, P EP ranks, X = E / P experts owned per rank, S replica slots per rank.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence


def plan_replicas(load: Sequence[float], ep: int, slots: int) -> list[list[int]]:
    """Replica slots per rank: slot_expert[r] lists the experts rank r holds copies of (<= slots each).

    load [E]: measured tokens per expert (any scale). Deterministic: ties go to the lower rank / expert id.
    """
    E = len(load)
    assert E % ep == 0 and slots >= 0
    X = E // ep
    copies = [1] * E
    holders = [{e // X} for e in range(E)]
    rank_load = [float(sum(load[j * X:(j + 1) * X])) for j in range(ep)]
    held = [list(range(j * X, (j + 1) * X)) for j in range(ep)]  # experts with a copy on rank j
    slot_expert: list[list[int]] = [[] for _ in range(ep)]
    while True:
        busiest = max(range(ep), key=lambda j: (rank_load[j], -j))
        best = None
        for e in sorted(held[busiest], key=lambda e: (-load[e] / copies[e], e)):
            share = load[e] / copies[e]
            if share <= 0:
                break
            free = [r for r in range(ep) if len(slot_expert[r]) < slots and r not in holders[e]]
            if not free:
                continue
            target = min(free, key=lambda r: (rank_load[r], r))
            new_share = load[e] / (copies[e] + 1)
            if rank_load[target] + new_share < rank_load[busiest] - 1e-12 * max(1.0, rank_load[busiest]):
                best = (e, target, share, new_share)
                break
        if best is None:
            return slot_expert
        e, target, share, new_share = best
        for r in holders[e]:
            rank_load[r] -= share - new_share
        rank_load[target] += new_share
        copies[e] += 1
        holders[e].add(target)
        held[target].append(e)
        slot_expert[target].append(e)


def rank_loads(load: Sequence[float], ep: int, slot_expert: list[list[int]]) -> list[float]:
    """Tokens per rank [P] under a plan, each expert's load split evenly over its copies."""
    E = len(load)
    X = E // ep
    copies = [1] * E
    for slots in slot_expert:
        for e in slots:
            copies[e] += 1
    out = [sum(load[e] / copies[e] for e in range(j * X, (j + 1) * X)) for j in range(ep)]
    for j, slots in enumerate(slot_expert):
        out[j] += sum(load[e] / copies[e] for e in slots)
    return out


def max_over_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else math.nan


def zipf_load(num_experts: int, skew: float, seed: int = 0) -> list[float]:
    """Expected tokens per expert (mean 1) when expert popularity is Zipf(skew), the ranks of popularity shuffled
    over the experts (a fixed seed): a stand-in for measured routing skew."""
    weights = [(i + 1) ** -skew for i in range(num_experts)]
    random.Random(seed).shuffle(weights)
    total = sum(weights)
    return [w * num_experts / total for w in weights]


@functools.lru_cache(maxsize=256)
def replicated_imbalance(imbalance: float, num_experts: int, ep: int, slots: int) -> float:
    """Max/mean tokens per EP rank after replication with `slots` replica slots per rank, for routing whose
    max/mean per rank is `imbalance` without it. Model: a Zipf expert popularity (shuffled over the experts) whose
    skew is chosen so the per-rank max/mean matches `imbalance`, then `plan_replicas`. Returns `imbalance` itself
    when there is nothing to do (slots 0, ep 1, or balanced routing)."""
    if slots <= 0 or ep <= 1 or imbalance <= 1.0 or num_experts % ep:
        return imbalance

    def per_rank(skew: float) -> float:
        load = zipf_load(num_experts, skew)
        return max_over_mean(rank_loads(load, ep, [[] for _ in range(ep)]))

    lo, hi = 0.0, 4.0
    if per_rank(hi) < imbalance:  # more skewed than the model reaches: price the most skewed case
        lo = hi
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if per_rank(mid) < imbalance else (lo, mid)
    load = zipf_load(num_experts, lo)
    return min(imbalance, max_over_mean(rank_loads(load, ep, plan_replicas(load, ep, slots))))


__all__ = ["max_over_mean", "plan_replicas", "rank_loads", "replicated_imbalance", "zipf_load"]
