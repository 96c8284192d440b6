"""Per-layer expert-load table of one or more runs, from their metrics.jsonl (issue #27's "Done when" check).

    python scripts/balance_summary.py RUN_DIR [RUN_DIR ...] [--from-step 50] [--loss-steps 50 100 200]

For every MoE layer, over the logged steps >= --from-step: the worst max/mean tokens per expert, the most idle experts,
the worst min/mean; then the train loss at --loss-steps (the logged step nearest each) and one verdict line per run:
PASS when every layer stays at max/mean <= --max-ratio with no idle expert. Needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def summarize(run: Path, from_step: int, loss_steps: list[int], max_ratio: float) -> bool:
    records = read(run)
    train = [r for r in records if "train/loss" in r]
    layers = sorted({k.split("/")[2] for r in train for k in r if k.startswith("train/load/") and k.count("/") == 3},
                    key=lambda s: (len(s), s))
    late = [r for r in train if r["step"] >= from_step]
    print(f"\n{run}: {len(train)} logged steps, last {train[-1]['step'] if train else '-'}; load over steps >= "
          f"{from_step} ({len(late)} logged)")
    if not late or not layers:
        print("  no expert-load records at those steps")
        return False
    print("| layer | worst max/mean | worst min/mean | most idle | max/mean at last step | worst rank max/mean |")
    print("|---|---|---|---|---|---|")
    ok = True
    for layer in layers:
        def vals(stat):
            return [r[f"train/load/{layer}/{stat}"] for r in late if r.get(f"train/load/{layer}/{stat}") is not None]

        mx, mn, idle, rank = vals("max_mean"), vals("min_mean"), vals("idle"), vals("rank_max_mean")
        last = late[-1].get(f"train/load/{layer}/max_mean")
        ok &= bool(mx) and max(mx) <= max_ratio and max(idle) == 0
        rank_txt = f"{max(rank):.2f}" if rank else "-"
        print(f"| {layer} | {max(mx):.2f} | {min(mn):.2f} | {int(max(idle))} | {last:.2f} | {rank_txt} |")
    losses = []
    for s in loss_steps:
        near = min(train, key=lambda r: abs(r["step"] - s))
        if abs(near["step"] - s) <= max(5, s // 10) and near.get("train/loss") is not None:
            losses.append(f"step {near['step']}: {near['train/loss']:.4f}")
    tok = [r["train/tokens_per_s"] for r in late if r.get("train/tokens_per_s")]
    print("loss " + ", ".join(losses) + (f"; median tokens/s over those steps {sorted(tok)[len(tok) // 2]:,.0f}"
                                         if tok else ""))
    print(f"{'PASS' if ok else 'FAIL'}: every layer max/mean <= {max_ratio} and no idle expert from step {from_step}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--from-step", type=int, default=50)
    ap.add_argument("--loss-steps", type=int, nargs="+", default=[50, 100, 200])
    ap.add_argument("--max-ratio", type=float, default=1.5)
    args = ap.parse_args()
    for run in args.runs:
        summarize(run, args.from_step, args.loss_steps, args.max_ratio)


if __name__ == "__main__":
    main()
