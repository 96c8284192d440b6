"""Expert-load telemetry and the per-step router-state plumbing of the training loop.

Per MoE layer and logging step, from the step's routed-slot counts per expert (the router counts them on the device
for the bias update; in distributed runs they are already summed over the stage's ranks):
    max_mean       max / mean tokens per expert (MaxVio + 1; 1 is perfect balance, E/K a collapsed router)
    min_mean       min / mean
    idle           experts that got no token
    cv             coefficient of variation (std / mean) of the tokens per expert
    rank_max_mean  under expert parallelism: max / mean tokens per EP rank (after hot-expert replication, if on)
Layers are stacked and reduced on the device; one host read per logging step for all layers. Records go to
metrics.jsonl / TensorBoard as "train/load/<layer>/<stat>" plus "train/load/worst_max_mean"; the progress bar shows
the worst layer; a layer above `collapse_idle_fraction` idle experts for `collapse_window` logging steps in a row
gets one warning line; at the end `expert_load.png` (layer x expert, load / mean) lands beside loss.png. With a plan,
the measured imbalance the cost model priced (the busiest EP rank's tokens / the mean under EP, else the busiest
expert's / the mean) is checked against the forecast plan.moe_load_imbalance: one warning line when it is above it
for `collapse_window` logging steps in a row.

Legend: L MoE layers, E experts, P EP ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

STATS = ("max_mean", "min_mean", "idle", "cv", "rank_max_mean")

RankLoadFn = Callable[[str, torch.Tensor], torch.Tensor]  # (layer, counts_E) -> tokens per EP rank [P]


# ------------------------------------------------------------------------------------------------------------
# router state, once per micro-batch / optimizer step


def finish_microbatch(moes: dict[str, nn.Module]) -> None:
    """After a micro-batch's backward: the global-batch loss's counts of that micro-batch join the step's."""
    for moe in moes.values():
        moe.router.finish_microbatch()


def reduce_router_state(moes: dict[str, nn.Module], group: dist.ProcessGroup | None) -> None:
    """Sum every router's per-step accumulators (tokens_per_expert, quantile_hist) over `group` in place: one
    all-reduce per dtype for all layers (moestack.parallel.comm.all_reduce_sum_)."""
    from moestack.parallel.comm import all_reduce_sum_

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for moe in moes.values():
        for name in moe.router.forward_counters:
            t = getattr(moe.router, name, None)
            if t is not None:
                by_dtype.setdefault(t.dtype, []).append(t)
    for tensors in by_dtype.values():
        all_reduce_sum_(tensors, group)


# ------------------------------------------------------------------------------------------------------------
# statistics


def load_stats(counts_LE: torch.Tensor, rank_load_LP: torch.Tensor | None = None) -> torch.Tensor:
    """[L, 5] float64 (STATS order) from tokens per expert counts_LE [L, E] (and tokens per EP rank [L, P], or None:
    rank_max_mean NaN). A layer without tokens gives NaN ratios. On counts_LE's device, no host sync."""
    c = counts_LE.double()
    mean = c.mean(-1)
    safe = torch.where(mean > 0, mean, torch.nan)
    out = [c.amax(-1) / safe, c.amin(-1) / safe, (c == 0).sum(-1).double(), c.std(-1, correction=0) / safe]
    if rank_load_LP is not None:
        r = rank_load_LP.double()
        out.append(r.amax(-1) / torch.where(r.mean(-1) > 0, r.mean(-1), torch.nan))
    else:
        out.append(torch.full_like(mean, torch.nan))
    return torch.stack(out, dim=-1)


def even_rank_load(counts_E: torch.Tensor, ep: int) -> torch.Tensor:
    """Tokens per EP rank [P] when rank j owns the contiguous experts [j*E/P, (j+1)*E/P) (no replication)."""
    return counts_E.view(ep, -1).sum(-1)


class ExpertLoadMonitor:
    """Turns the step's counts into records, a progress-bar column, collapse warnings and the final heatmap.

    layer names: the trainer's moe_layers() keys; ep: EP degree (1: no per-rank stat); rank_load: per-rank tokens
    under the current expert placement (default: contiguous blocks); warn: the trainer's rank-0 log.
    """

    def __init__(self, layers: list[str], num_experts: int, collapse_idle_fraction: float, collapse_window: int,
                 ep: int = 1, rank_load: RankLoadFn | None = None, warn: Callable[[str], None] = print,
                 forecast: float | None = None):
        self.layers, self.num_experts = list(layers), num_experts
        self.forecast, self.forecast_streak, self.forecast_warned = forecast, 0, False
        self.idle_fraction, self.window = collapse_idle_fraction, collapse_window
        self.ep = ep
        self.rank_load = rank_load or (lambda _name, c: even_rank_load(c, ep))
        self.warn = warn
        self.streak = {name: 0 for name in self.layers}
        self.column = ""
        self.last_step: int | None = None
        self.last_counts: torch.Tensor | None = None  # [L, E] float64 on the host

    def observe(self, step: int, counts: dict[str, torch.Tensor]) -> dict[str, float]:
        """Record entries for this logging step (one host read for every layer); updates the progress column and
        the collapse streaks (warning once when a streak reaches the window)."""
        if not counts:
            return {}
        names = [n for n in self.layers if n in counts]
        counts_LE = torch.stack([counts[n].reshape(-1) for n in names])
        ranks = torch.stack([self.rank_load(n, counts[n].reshape(-1)) for n in names]) if self.ep > 1 else None
        stats = load_stats(counts_LE, ranks)
        host = torch.cat([stats.reshape(-1), counts_LE.double().reshape(-1)]).cpu()
        table = host[: stats.numel()].view(len(names), len(STATS)).tolist()
        self.last_counts = host[stats.numel():].view(len(names), -1)
        self.last_step = step
        record: dict[str, float] = {}
        for name, row in zip(names, table, strict=True):
            for stat, value in zip(STATS, row, strict=True):
                if stat != "rank_max_mean" or self.ep > 1:
                    record[f"load/{name}/{stat}"] = value
            self._collapse(step, name, int(row[2]))
        worst = max(range(len(names)), key=lambda i: _nan_low(table[i][0]))
        record["load/worst_max_mean"] = table[worst][0]
        record["load/idle_experts"] = float(sum(int(r[2]) for r in table))
        ranks_txt = ""
        if self.ep > 1:
            record["load/worst_rank_max_mean"] = max(_nan_low(r[4]) for r in table)
            ranks_txt = f" rank {record['load/worst_rank_max_mean']:.2f}"
        self.column = (f"load {table[worst][0]:.2f} (L{names[worst]}) idle {int(record['load/idle_experts'])}"
                       f"{ranks_txt}")
        self._check_forecast(step, record["load/worst_rank_max_mean"] if self.ep > 1 else table[worst][0])
        return record

    def _check_forecast(self, step: int, measured: float) -> None:
        """One warning when the measured imbalance stays above plan.moe_load_imbalance for `window` logging steps."""
        if self.forecast is None or self.forecast_warned:
            return
        self.forecast_streak = self.forecast_streak + 1 if measured > self.forecast else 0
        if self.forecast_streak == self.window:
            self.forecast_warned = True
            what = "busiest EP rank's tokens / mean" if self.ep > 1 else "busiest expert's tokens / mean"
            self.warn(f"warning: plan.moe_load_imbalance {self.forecast:g} is below the measured load imbalance "
                      f"({what} {measured:.2f} at step {step}, above the forecast for {self.window} logging steps "
                      f"in a row): the planner priced this run too optimistically; re-plan with moe_load_imbalance "
                      f"{measured:.2f} (or plan.ep_replicas for hot-expert replication), or balance the routing "
                      "(model.moe.router)")

    def _collapse(self, step: int, name: str, idle: int) -> None:
        if idle > self.idle_fraction * self.num_experts:
            self.streak[name] += 1
            if self.streak[name] == self.window:
                self.warn(f"warning: MoE layer {name} collapsed: {idle}/{self.num_experts} experts idle at step "
                          f"{step}, more than {self.idle_fraction:.0%} for {self.window} logging steps in a row "
                          "(model.moe.router: bias_update quantile, z_loss_coef / global_aux_loss_coef, or a "
                          "lower lr)")
        else:
            self.streak[name] = 0

    def heatmap(self, png: str | Path) -> Path | None:
        """Layer x expert load / mean of the last logged step as a PNG (matplotlib Agg); None before any step."""
        if self.last_counts is None:
            return None
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import TwoSlopeNorm
        from matplotlib.figure import Figure

        c = self.last_counts
        mean = c.mean(-1, keepdim=True)
        rel = (c / torch.where(mean > 0, mean, torch.ones_like(mean))).numpy()
        L, E = rel.shape
        fig = Figure(figsize=(min(14.0, 3.0 + E / 12), 1.6 + 0.3 * L), dpi=120)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        norm = TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=max(2.0, float(rel.max())))  # white = balanced
        im = ax.imshow(rel, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
        ax.set_yticks(range(L), [f"L{n}" for n in self.layers[:L]])
        ax.set_xlabel("expert")
        ax.set_title(f"tokens per expert / mean, step {self.last_step} (white: balanced, blue: under, red: over)")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        png = Path(png)
        png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png)
        return png


def _nan_low(v: float) -> float:
    return -math.inf if v != v else v


__all__ = ["STATS", "ExpertLoadMonitor", "even_rank_load", "finish_microbatch", "load_stats",
           "reduce_router_state"]
