"""Training metrics: a JSON-lines log (always), TensorBoard scalars (optional), a loss-curve PNG, and a short
text summary of MoE expert load.

metrics.jsonl holds one object per `log` call: {"step": 10, "time": 1712.3, "train/loss": 2.31, "train/lr": ...};
non-finite values are written as null. Lines are appended whole (moestack/train/run_dir.py), and a run that starts
at step S (`start_step`) first rewrites the file to the records of steps <= S, so a resumed run holds each step once.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path

import torch

from moestack.train.run_dir import LineAppender, read_jsonl, rewind_jsonl


class MetricsLogger:
    """Append metrics to out_dir/metrics.jsonl and, if `tensorboard`, to TensorBoard event files in out_dir/tb.

    Call from one rank only (rank 0) in multi-process runs. start_step: the run continues from this step (0: a new
    run): records of later steps and unreadable lines are dropped first (`dropped` says how many: (later, torn)),
    and TensorBoard purges its events after it. None appends to whatever is there.
    """

    def __init__(self, out_dir: str | Path, tensorboard: bool, start_step: int | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self.dropped = rewind_jsonl(self.path, start_step) if start_step is not None else (0, 0)
        self._file = LineAppender(self.path)
        self._writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:  # tensorboard is optional at runtime: keep training, say so once
                warnings.warn(f"TensorBoard logging off ({err}); metrics still go to {self.path}", stacklevel=2)
            else:
                purge = start_step + 1 if start_step else None  # events after the resumed step are replayed
                self._writer = SummaryWriter(log_dir=str(self.out_dir / "tb"), purge_step=purge)

    def log(self, step: int, values: dict[str, float], prefix: str = "train") -> None:
        """Record `values` (floats or 0-d tensors) at `step` as "<prefix>/<name>"."""
        record: dict[str, float | int | None] = {"step": int(step), "time": round(time.time(), 3)}
        for name, value in values.items():
            v = float(value.item() if isinstance(value, torch.Tensor) else value)
            record[f"{prefix}/{name}"] = v if math.isfinite(v) else None
            if self._writer is not None:
                self._writer.add_scalar(f"{prefix}/{name}", v, int(step))
        self._file.write(json.dumps(record))

    def sync(self) -> None:
        """Make the records so far durable (called next to each checkpoint)."""
        self._file.sync()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def read_metrics(metrics_jsonl: str | Path) -> list[dict]:
    """All records of a metrics.jsonl (a torn last line from a crash is skipped)."""
    return read_jsonl(metrics_jsonl)[0]


def plot_loss_curve(metrics_jsonl: str | Path, png: str | Path) -> Path:
    """Plot train/loss and eval/loss against step into `png` (matplotlib, Agg; no display needed). Returns png."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_jsonl)
    fig = Figure(figsize=(7, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, style in (("train/loss", "-"), ("eval/loss", "o-")):
        by_step = {r["step"]: r[key] for r in records if r.get(key) is not None}  # one point per step: the latest
        if by_step:
            steps, losses = zip(*sorted(by_step.items()))
            ax.plot(steps, losses, style, label=key, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    return png


def format_expert_load(counts_per_layer: dict[str, torch.Tensor]) -> str:
    """One line per MoE layer from token counts per expert ([E] each):
    "<layer>: max/mean 1.83  min/mean 0.21  idle 3/64 (4.7%)". Perfect balance gives max/mean = min/mean = 1."""
    lines = []
    for name, counts in counts_per_layer.items():
        c = counts.detach().double().cpu().reshape(-1)
        mean = c.mean().item()
        idle = int((c == 0).sum())
        if mean > 0:
            ratios = f"max/mean {c.max().item() / mean:.2f}  min/mean {c.min().item() / mean:.2f}"
        else:
            ratios = "no tokens"
        lines.append(f"{name}: {ratios}  idle {idle}/{c.numel()} ({100.0 * idle / c.numel():.1f}%)")
    return "\n".join(lines)
