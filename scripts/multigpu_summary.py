"""Tables for scripts/multigpu_check.sh: layouts against the single-device run, and weak scaling.

    python3 scripts/multigpu_summary.py layouts DIR single ep8 ep4_tp2 ...   # DIR/run_NAME, DIR/plan_NAME.yaml
    python3 scripts/multigpu_summary.py scaling DIR weak1 weak2 weak4 weak8

Per run: metrics.jsonl (train/loss, train/tokens_per_s, train/mfu, train/peak_mem_gib per step) and the plan with
the planner's prediction (`predicted` in plan.yaml). Steady state = the second half of the steps (median).
Loss agreement: the largest |loss - loss of the reference run| over steps, and the same over the mean of the last
10 steps (bf16 runs differ step to step by reduction order; the curve, not one step, is the check).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import yaml


def load(run_dir: Path, plan_path: Path) -> dict | None:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "train/loss" in r]
    if not train:
        return None
    plan = yaml.safe_load(plan_path.read_text()) if plan_path.is_file() else {}
    tail = train[len(train) // 2:]

    def med(key):
        vals = [r[key] for r in tail if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {"loss": {r["step"]: r["train/loss"] for r in train}, "tps": med("train/tokens_per_s"),
            "mfu": med("train/mfu"), "peak": max((r.get("train/peak_mem_gib") or 0.0) for r in train) or None,
            "plan": plan, "devices": plan.get("devices", 1),
            "tokens_per_step": plan.get("global_batch_size", 1) * plan.get("seq_len", 1)}


def fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def layouts(root: Path, ref_name: str, names: list[str]) -> None:
    ref = load(root / f"run_{ref_name}", root / f"plan_{ref_name}.yaml")
    print("| layout | devices | steps | max abs loss diff vs 1 device | last-10 mean diff | tokens/s per device | MFU | "
          "peak GiB | planner step s / measured | planner GiB / measured |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    curves = {}
    for name in [ref_name, *names]:
        r = load(root / f"run_{name}", root / f"plan_{name}.yaml")
        if r is None:
            print(f"| {name} | - | no metrics (see {root}/train_{name}.log) | | | | | | | |")
            continue
        curves[name] = r["loss"]
        steps = sorted(r["loss"])
        if ref is not None and name != ref_name:
            common = [s for s in steps if s in ref["loss"]]
            diff = max(abs(r["loss"][s] - ref["loss"][s]) for s in common) if common else None
            last = common[-10:]
            mean_diff = (statistics.mean(r["loss"][s] for s in last) - statistics.mean(ref["loss"][s] for s in last)
                         if last else None)
        else:
            diff = mean_diff = None
        pred = (r["plan"] or {}).get("predicted") or {}
        step_meas = r["tokens_per_step"] / r["tps"] if r["tps"] else None
        step_pred = pred.get("step_time_s")
        # allocated peak: the planner's total without its "reserved" allowance (the measurement is max allocated)
        mem_pred = sum(v for k, v in (pred.get("memory_gib") or {}).items() if k != "reserved") or None
        time_cmp = f"{step_pred:.3f} / {step_meas:.3f} ({100 * (step_pred / step_meas - 1):+.0f}%)" \
            if step_pred and step_meas else "-"
        mem_cmp = f"{mem_pred:.1f} / {r['peak']:.1f} ({100 * (mem_pred / r['peak'] - 1):+.0f}%)" \
            if mem_pred and r["peak"] else "-"
        per_dev = r["tps"] / r["devices"] if r["tps"] else None
        print(f"| {name} | {r['devices']} | {len(steps)} | {fmt(diff, '.4f')} | {fmt(mean_diff, '+.4f')} | "
              f"{fmt(per_dev, ',.0f')} | {pct(r['mfu'])} | {fmt(r['peak'], '.1f')} | "
              f"{time_cmp} | {mem_cmp} |")
    _plot(curves, root / "layouts_loss.png")


def scaling(root: Path, names: list[str]) -> None:
    print("| devices | tokens/s | tokens/s per device | weak-scaling efficiency | MFU | planner tokens/s |")
    print("|---|---|---|---|---|---|")
    base = None
    for name in names:
        r = load(root / f"run_{name}", root / f"plan_{name}.yaml")
        if r is None or not r["tps"]:
            print(f"| {name} | no metrics (see {root}/train_{name}.log) | | | | |")
            continue
        per_dev = r["tps"] / r["devices"]
        base = base or per_dev
        pred = ((r["plan"] or {}).get("predicted") or {}).get("tokens_per_s")
        print(f"| {r['devices']} | {r['tps']:,.0f} | {per_dev:,.0f} | {100 * per_dev / base:.0f}% | "
              f"{pct(r['mfu'])} | {fmt(pred, ',.0f')} |")


def _plot(curves: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, loss in curves.items():
        steps = sorted(loss)
        ax.plot(steps, [loss[s] for s in steps], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"loss curves: {path}")


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[1] not in ("layouts", "scaling"):
        raise SystemExit("usage: multigpu_summary.py layouts|scaling DIR NAME [NAME ...]")
    root = Path(sys.argv[2])
    if sys.argv[1] == "layouts":
        layouts(root, sys.argv[3], sys.argv[4:])
    else:
        scaling(root, sys.argv[3:])


if __name__ == "__main__":
    main()
