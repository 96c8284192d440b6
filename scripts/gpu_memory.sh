#!/usr/bin/env bash
# Memory policies on ONE H200 (issue #9): the offload rows and the largest proxy variant, in one call of < 7 min.
#   long     at SEQ (16384, where the baseline does not fit): "recompute full" (the reference of the saved / time
#            added columns; its first step also compiles the Triton kernels for the rows after it), then
#            "expert offload", "optimizer offload", "all combined"
#   largest  everything combined (full recompute, activation / expert / optimizer offload, bf16 AdamW states, FP8
#            saved expert inputs) at SEQ with more experts, searched downwards: EXPERTS (384,320,256,192) in order,
#            a row whose host bytes (14 B per expert parameter; the pinned weight, gradient and shadow tensors
#            rounded up to a power of two by torch's host allocator: 256 experts ~95 GB, 320 / 384 ~161 / 167 GB;
#            + 12 B per other parameter) exceed HOST_FRACTION of
#            MemAvailable is skipped at once, the first row that trains ends the search. The device is not the
#            limit (all combined at 16384: ~14 GiB); 128 experts is the long phase's "all combined" row.
#   CUDA_VISIBLE_DEVICES=0 bash scripts/gpu_memory.sh
# Every row runs in its own process with its own limit (ROW_S; an OOM, a crash or a hang ends only that row) and its
# table row is printed (and appended to rows.md) as soon as it finishes; each phase stops starting rows at its
# deadline. Everything (logs, JSON, rows.md) ends up in ONE file: $OUT/memory.tgz (also when the script is cut).
# Host threads: torch's intra-op pool is set to max(4, nproc / 2 - 1) (TORCH_THREADS): the CPU optimizer step is
# memory-bound, and an OpenMP pool that shares its cores with another job waits on descheduled threads (measured on
# the 2-core machine under load: 8 ms per fused-AdamW call whatever its size, vs 12 us on one free thread).
# Env: PYTHON (python3), SEQ (16384), BUDGET_S (whole script, default 400), ROW_S (per-row limit of the long phase,
# 100), LONG_ROWS, EXPERTS (384,320,256,192), HOST_FRACTION (0.8), WARMUP (1), STEPS (2), LARGEST_STEPS (1).
# CPU dry run of the script logic: DEVICE=cpu MODEL=tiny SEQ=64 EXPERTS=32,16 bash scripts/gpu_memory.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${OUT:-runs/memory}
mkdir -p "$OUTDIR"
DEST=$(mktemp -d "${TMPDIR:-/tmp}/gpu_memory.XXXXXX")
SEQ=${SEQ:-16384}
MODEL=${MODEL:-proxy}
DEVICE=${DEVICE:-cuda}
EXPERTS=${EXPERTS:-384,320,256,192}
BUDGET=${BUDGET_S:-400}
ROW_S=${ROW_S:-100}
HOSTF=${HOST_FRACTION:-0.8}
LONG_ROWS=${LONG_ROWS:-recompute full,expert offload,optimizer offload,all combined}
T0=$(date +%s)
pack() {  # the one output file; runs on every exit (a cut run still leaves what finished)
  tar -czf "$OUTDIR/memory.tgz" -C "$DEST" . 2>/dev/null && echo "gpu_memory.sh: outputs in $OUTDIR/memory.tgz"
}
trap pack EXIT
trap 'exit 143' TERM INT
# one config per Triton kernel (memory.py --no-autotune: kernels.autotune false); Triton's autotune results cached on
# disk across the row processes
export TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
NT=$(( $(nproc) / 2 - 1 )); [ "$NT" -lt 4 ] && NT=4
export OMP_NUM_THREADS=${TORCH_THREADS:-$NT}
COMMON=(--model "$MODEL" --device "$DEVICE" --warmup "${WARMUP:-1}" --no-report --no-autotune)
# the planner's calibration for the proxy: `moestack tune proxy` on an H200 (2026-11-29): measured saved bytes per part
[ "$MODEL" = proxy ] && COMMON+=(--calibration benchmarks/calibration-proxy-h200.json)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
filt() { grep --line-buffered -v -e "UserWarning" -e "return float"; }
# the table rows as each finishes (memory.py prints the whole table again at the end: stop at its second header)
rows() { awk '/^\| technique/ {n++} n == 1 && /^\| / && !/^\| technique/ && !/^\|---/ {print; fflush()}' >> "$DEST/rows.md"; }
live() { awk '/^\| technique/ {n++} (n == 1 && /^\|/) || /Traceback|feed back|^  timing:|^  log tail:|^    \[/ {print; fflush()}'; }  # console
{
  echo "gpu_memory.sh: $MODEL on $DEVICE (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}), seq $SEQ, budget ${BUDGET}s, row limit ${ROW_S}s, $(nproc) CPUs"
  grep -E "MemTotal|MemAvailable" /proc/meminfo
  [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader 2>/dev/null
  $PY -c 'import torch; print("torch", torch.__version__, "threads", torch.get_num_threads())'
} 2>&1 | tee "$DEST/env.txt"

echo "## long (seq $SEQ)"
D=$(( $(left) * 62 / 100 ))
timeout -k 10 $((D + 30)) $PY benchmarks/memory.py --phase long --seq-len "$SEQ" --only "$LONG_ROWS" \
  "${COMMON[@]}" --steps "${STEPS:-2}" --row-timeout-s "$ROW_S" --deadline-s "$D" --json "$DEST/long.json" 2>&1 | filt \
  | tee "$DEST/long.log" | tee >(rows) | live
echo
echo "## largest (all combined, seq $SEQ, experts $EXPERTS, searched downwards)"
D=$(( $(left) - 15 ))
if [ "$D" -ge 40 ]; then
  timeout -k 10 $((D + 30)) $PY benchmarks/memory.py --phase largest --search down --seq-len "$SEQ" --seq-lens "" \
    --experts "$EXPERTS" --host-fraction "$HOSTF" "${COMMON[@]}" --steps "${LARGEST_STEPS:-1}" --deadline-s "$D" \
    --json "$DEST/largest.json" 2>&1 | filt | tee "$DEST/largest.log" | tee >(rows) | live
else
  echo "no time left for the largest phase ($D s)"
fi
sleep 1  # let the rows.md writers finish
echo
echo "## rows (as finished)"
cat "$DEST/rows.md" 2>/dev/null
echo "gpu_memory.sh: done in $(($(date +%s) - T0)) s"
