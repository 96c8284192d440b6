#!/usr/bin/env bash
# GPU checks on the H200: the GPU-marked tests in parts that each fit one 10-minute device call (scripts/gpu_parts.py
# balances them by the seconds in scripts/gpu_durations.json), a table of passed / failed / skipped per test file,
# then the benchmarks named as arguments.
#   bash scripts/gpu_check.sh --list                   # the parts and their estimated seconds
#   bash scripts/gpu_check.sh --part 2 -n 4            # part 2, its tests on 4 pytest-xdist workers
#   bash scripts/gpu_check.sh --part all               # every part in turn (longer than one device call)
#   bash scripts/gpu_check.sh --part 1 benchmarks/kda.py   # part 1, then the KDA benchmark
#   bash scripts/gpu_check.sh --part 1 --dry-run       # the pytest commands only (also on a CPU machine)
# Flags: --list | --part K|all, -n N (xdist workers, default 1; --list with the same -n shows the same parts),
# --timeout S (per test, default 300), --budget S (seconds per part, default 540: the collection and ~1 min of Triton
# compiles included), --dry-run. Env: PYTHON (default python3), OUT (junit files and logs; default runs/gpu_check),
# NO_WHL=1 to skip installing carried wheels from .whl/ (the device image has no pydantic).
# After a full run, fold the measured seconds back in: python3 scripts/gpu_parts.py durations OUT/part*.xml
# Without a GPU the tests collect and skip: a dry run of the partition and the table.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh  # carried wheels, PYTHONPATH
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOGDIR=${OUT:-runs/gpu_check}
mkdir -p "$LOGDIR"

cmd=run
args=()
benches=()
while [ $# -gt 0 ]; do
  case "$1" in
    --list) cmd=list ;;
    --part|-n|--jobs|--timeout|--budget) args+=("$1" "$2"); shift ;;
    --dry-run) args+=("$1") ;;
    -*) echo "gpu_check.sh: unknown flag $1 (see the header of $0)" >&2; exit 2 ;;
    *) benches+=("$1") ;;
  esac
  shift
done

echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo 'no GPU') at $(git rev-parse --short HEAD 2>/dev/null), $(date -u +%F)"
$PY scripts/gpu_parts.py "$cmd" --python "$PY" --out "$LOGDIR" "${args[@]}"
rc=$?
for bench in "${benches[@]}"; do
  echo "== $bench"
  $PY "$bench" 2>&1 | tee "$LOGDIR/$(basename "$bench" .py).log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
for bench in "${benches[@]}"; do
  grep -h "^|" "$LOGDIR/$(basename "$bench" .py).log"
done
exit $rc
