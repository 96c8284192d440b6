"""The planner against published training runs: prints the validation table (CPU only, seconds).

    python3 benchmarks/planner_validation.py [--runs tests/data/planner/published_runs.yaml] [--calibration cal.json]

Each run of the data file (Megatron-Bridge performance tables, the Llama 3 / GPT-3 / DeepSeek-V3 papers; sources in
the file) is evaluated with `moestack plan --fix` on its published configuration and its framework's host profile
(moestack/planner/validation.py); the table gives published vs predicted throughput, the predicted memory against
the device's HBM and the plan the search chose for what the publication leaves open. tests/planner/test_validation.py
asserts the bounds of issue #29 (median |error| <= 10%, worst <= 35%, no published run over HBM).
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from moestack.planner.calibration import load_calibration
from moestack.planner.validation import PUBLISHED_RUNS, evaluate_all, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=PUBLISHED_RUNS)
    ap.add_argument("--calibration", type=Path, default=None)
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout
    print(f"runs: {args.runs}; calibration: {args.calibration or 'default'}; commit {commit.strip() or '?'}")
    for line in table(evaluate_all(args.runs, load_calibration(args.calibration))):
        print(line)


if __name__ == "__main__":
    main()
