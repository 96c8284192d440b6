"""The planner's top plan for each model on each cluster preset, dry-run at its full world size on this CPU.

    python scripts/dry_run_top_plans.py [--models kimi-k3,deepseek-v3,qwen3-235b] [--clusters h200-cluster,...]
        [--no-step] [--out DIR]

For every (model, cluster): `moestack plan MODEL --cluster C -o DIR/MODEL@C.yaml`, then
`moestack train --plan DIR/MODEL@C.yaml --dry-run --rank R` for rank 0 (first and, under V-shape schedules, last
pipeline stage) and, for other pipeline schedules, the last rank (the LM head's stage). Prints one `|` table row per
run: search and dry-run wall seconds, the plan, and the dry run's verdict (ok, or its one-line error).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

MODELS = {"kimi-k3": "kimi-k3", "deepseek-v3": "tests/data/hf_configs/deepseek-v3.config.json",
          "qwen3-235b": "tests/data/hf_configs/qwen3-235b-a22b.config.json"}
PRESETS = Path(__file__).resolve().parents[1] / "moestack" / "config" / "presets"
CLUSTERS = sorted(p.stem.removeprefix("cluster-") for p in PRESETS.glob("cluster-*.yaml"))  # every cluster preset


def _run(cmd: list[str]) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def _error_line(text: str) -> str:
    """The run's error: the CLI's one `error:` line, else the traceback's last `...Error: ...` line (not a source
    line the traceback quotes), else the last line."""
    lines = [ln.removeprefix("[rank0]:").strip() for ln in text.splitlines()]
    for pattern in (r"^error:", r"^[A-Za-z_.]*(Error|Exception)\b.*:"):
        found = [ln for ln in lines if re.match(pattern, ln)]
        if found:
            return found[-1]
    return lines[-1] if lines else "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--clusters", default=",".join(CLUSTERS))
    ap.add_argument("--no-step", action="store_true", help="build and count only (no fake step)")
    ap.add_argument("--out", default="runs/top_plans")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "moestack"]
    print("| model | cluster | search s | plan | rank | dry run s | result |")
    print("|---|---|---|---|---|---|---|")
    failures = 0
    for name in args.models.split(","):
        for cluster in args.clusters.split(","):
            path = out / f"{name}@{cluster}.yaml"
            rc, text, t_plan = _run([*py, "plan", MODELS[name], "--cluster", cluster, "-o", str(path), "--top", "1"])
            if rc != 0:
                reason = next((ln for ln in text.splitlines() if ln.startswith("error:")), text[-200:])
                print(f"| {name} | {cluster} | {t_plan:.0f} | - | - | - | {reason.strip()} |")
                continue
            from moestack.config.plan import V_SHAPE, load_plan

            plan = load_plan(path)
            ranks = [0] if plan.pp == 1 or plan.schedule in V_SHAPE else [0, plan.devices - 1]
            for rank in ranks:
                cmd = [*py, "train", "--plan", str(path), "--dry-run", "--rank", str(rank)]
                rc, text, t_dry = _run(cmd + (["--no-step"] if args.no_step else []))
                verdict = "ok" if rc == 0 else _error_line(text)
                failures += rc != 0
                (out / f"{name}@{cluster}.rank{rank}.txt").write_text(text)
                print(f"| {name} | {cluster} | {t_plan:.0f} | {plan.short()} {plan.schedule} | {rank} | "
                      f"{t_dry:.0f} | {verdict.strip()[:160]} |", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
