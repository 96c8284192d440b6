#!/usr/bin/env bash
# Planner validation on one GPU (issue #4): tune the calibration at the model's shapes, then planner vs measured.
#   bash scripts/gpu_planner.sh [MODEL] [GRID]      # OUT=folder for the calibration, logs and JSON
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-proxy}
GRID=${2:-}
DEST=${OUT:-runs/planner}
mkdir -p "$DEST"
PY=${PYTHON:-python3}
timeout 240 $PY -m moestack tune "$MODEL" --out "$DEST/calibration-$MODEL.json" 2>&1 | tail -8
$PY benchmarks/planner_measured.py --model "$MODEL" --calibration "$DEST/calibration-$MODEL.json" \
  ${GRID:+--grid "$GRID"} --json "$DEST/planner_measured-$MODEL.json" 2>&1 | tee "$DEST/planner_measured-$MODEL.log"
