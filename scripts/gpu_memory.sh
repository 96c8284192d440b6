#!/usr/bin/env bash
# Memory policies on the H200 (issue #9), in under 7 minutes of wall clock:
#   long     every technique alone at a sequence length the baseline cannot train (SEQ, default 16384): peak GiB,
#            saved GiB and time added vs the baseline (or "recompute full" when the baseline does not fit), the
#            planner's peak for the same plan and its error
#   largest  everything combined (full recompute, activation / expert / optimizer offload, bf16 AdamW states, FP8
#            saved expert inputs), growing num_experts (128, 256, 384) and, alternating, the sequence (32768, 65536)
#            until a row does not fit (device OOM, or host memory for the offloaded experts)
#   bash scripts/gpu_memory.sh     # 2+ GPUs: long on GPU 0 and largest on GPU 1 at once; 1 GPU: one after the other
# Every row runs in its own process (an OOM or a CUDA error ends only that row) and is printed when it finishes;
# each phase stops starting rows at its deadline. Logs and JSON: $OUT (default runs/memory).
# Env: PYTHON (python3), SEQ (16384), BUDGET_S (wall budget of the whole script, default 390 s), EXPERTS (128,256,384),
# SEQS (32768,65536). CPU dry run of the script itself: DEVICE=cpu MODEL=tiny SEQ=64 EXPERTS=16,32 SEQS=128.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-runs/memory}
mkdir -p "$DEST"
SEQ=${SEQ:-16384}
MODEL=${MODEL:-proxy}
DEVICE=${DEVICE:-cuda}
EXPERTS=${EXPERTS:-128,256,384}
SEQS=${SEQS:-32768,65536}
BUDGET=${BUDGET_S:-390}
# one config per Triton kernel where moestack has a switch; autotune results cached on disk across the row processes
export MOESTACK_KDA_AUTOTUNE=0 MOESTACK_DSA_AUTOTUNE=0 TRITON_CACHE_AUTOTUNING=1
COMMON=(--model "$MODEL" --device "$DEVICE" --warmup 1 --steps 2)
# the planner's calibration for the proxy: `moestack tune proxy` on an H200 (2026-11-29): measured saved bytes per part
[ "$MODEL" = proxy ] && COMMON+=(--calibration benchmarks/calibration-proxy-h200.json)
NGPU=0
if [ "$DEVICE" = cuda ]; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "$NGPU" -gt 0 ] 2>/dev/null || NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
fi
LONG_ROWS="baseline,recompute full,recompute selective,activation offload,fp8 saved expert inputs,adamw bf16 states,muon,expert offload,optimizer offload,all combined"
echo "gpu_memory.sh: $MODEL on $DEVICE, $NGPU GPU(s), seq $SEQ, budget ${BUDGET}s, logs in $DEST"

long() {  # $1 = deadline (s)
  timeout -k 10 $(($1 + 25)) $PY benchmarks/memory.py --phase long --seq-len "$SEQ" --only "$LONG_ROWS" \
    "${COMMON[@]}" --deadline-s "$1" --json "$DEST/long.json" 2>&1 | grep --line-buffered -v -e "UserWarning" -e "return float" \
    | tee "$DEST/long.log"
}
largest() {  # $1 = deadline (s), $2 = share of MemAvailable the offloaded experts may take
  timeout -k 10 $(($1 + 25)) $PY benchmarks/memory.py --phase largest --seq-len "$SEQ" --experts "$EXPERTS" \
    --seq-lens "$SEQS" --no-report --host-fraction "$2" "${COMMON[@]}" --deadline-s "$1" \
    --json "$DEST/largest.json" 2>&1 | grep --line-buffered -v -e "UserWarning" -e "return float" > "$DEST/largest.log"
}

T0=$(date +%s)
echo "## long"
if [ "$NGPU" -ge 2 ]; then
  D=$((BUDGET - 30))
  # both phases share the host: the largest phase leaves a quarter of MemAvailable for the long phase's offload
  # rows (<= ~65 GB of host memory each)
  CUDA_VISIBLE_DEVICES=1 largest "$D" 0.75 &
  PID=$!
  CUDA_VISIBLE_DEVICES=0 long "$D"
  wait "$PID"
else
  D1=$(((BUDGET - 40) * 6 / 10))
  D2=$((BUDGET - 40 - D1))
  long "$D1"
  largest "$D2" 0.85
fi
echo
echo "## largest"
cat "$DEST/largest.log"
echo
echo "gpu_memory.sh: done in $(($(date +%s) - T0)) s"
