#!/usr/bin/env bash
# GPU checks on the H200: all GPU-marked tests, then the benchmarks named as arguments, then a short table.
#   scripts/gpu_check.sh                          # tests only
#   scripts/gpu_check.sh benchmarks/kda.py        # tests + the KDA benchmark
# Env: PYTHON (default python3), TESTS (default: the whole tests/ folder), OUT (a folder for the logs).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGDIR=${OUT:-$(mktemp -d)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# -s keeps the error lines that GPU tests print (tagged *_GPU_ERR) in the log.
$PY -m pytest -m gpu -s -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$LOGDIR/gpu_tests.log"
rc=${PIPESTATUS[0]}
for bench in "$@"; do
    echo "== $bench"
    $PY "$bench" 2>&1 | tee "$LOGDIR/$(basename "$bench" .py).log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done

echo
echo "== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
grep -E "[0-9]+ (passed|failed)|error" "$LOGDIR/gpu_tests.log" | tail -1
grep -h "_GPU_ERR" "$LOGDIR/gpu_tests.log" | sed 's/^.*_GPU_ERR/  /'
for bench in "$@"; do
    grep -h "^|" "$LOGDIR/$(basename "$bench" .py).log"
done
exit $rc
