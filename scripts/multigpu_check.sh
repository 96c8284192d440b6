#!/usr/bin/env bash
# Multi-GPU check (issue #10): hybrid-parallel layouts against the single-device run, all-to-all bandwidth, weak
# scaling and planner-vs-measured, in one call; prints markdown tables (rows start with "|").
#
#   bash scripts/multigpu_check.sh                       # on an 8 (or 4, 2) GPU machine: the proxy model
#   DEVICE=cpu NPROC=2 MODEL=tiny STEPS=3 SEQ=64 bash scripts/multigpu_check.sh   # CPU dry run on gloo
#
# Env: MODEL (proxy), STEPS (200), SEQ (4096), GBS (global batch in sequences, 16), NPROC (GPUs found),
#      SCALE_STEPS (30, weak scaling runs), OUT (a folder; default runs/multigpu), PHASES ("layouts a2a scaling",
#      any subset), PYTHON (python3), CALIBRATION (a `moestack tune` JSON to reuse instead of tuning first; the
#      measured collective bandwidths of `moestack tune-comm` are merged into a copy of it, $OUT/calibration_comm.json),
#      PACK (a .tgz written on exit with everything but checkpoints / tensorboard: a device call returns <= 8 files),
#      LAYOUTS (a comma list of the layout names below to run, in that order, e.g. "tp2,ep2"; default all),
#      PROFILE (a comma list of layout names, "single" included, e.g. "single,tp2": those runs get
#      `--profile-steps 6:9`, i.e. torch.profiler over steps 6..8 after 5 warm-up steps, and every rank writes
#      run_NAME/profile_rank{r}.txt (top ops by self device / self CPU time) and .json.gz (chrome trace); PACK keeps
#      them; needs STEPS >= 8),
#      PHASE_PEAKS (a comma list of layout names: step 10 of those runs records the peak allocated memory per phase,
#      run_NAME/phase_peaks_rank{r}.json, moestack/memory/phase_peaks.py; needs STEPS >= 10),
#      MEASURE_HOST (set: `moestack tune --measure-host`, the host floor measured on this machine; when tune runs),
#      TUNE_COMM (1; 0 skips `moestack tune-comm`, e.g. when CALIBRATION already holds its `comm` section),
#      SINGLE_FROM (a folder holding run_single/ and plan_single.yaml of an earlier call with the same STEPS / SEQ /
#      GBS: reused as the reference instead of training it again; the device calls are 10 minutes each).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 etc.): the lent machines require it.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then
  NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
else
  NPROC=${NPROC:-2}
  export OMP_NUM_THREADS=1
fi
MODEL=${MODEL:-proxy}
STEPS=${STEPS:-200}
SCALE_STEPS=${SCALE_STEPS:-30}
SEQ=${SEQ:-4096}
GBS=${GBS:-16}
DEST=${OUT:-runs/multigpu}
PHASES=${PHASES:-layouts a2a scaling}
CLUSTER=h200-cluster
mkdir -p "$DEST"
[ -n "${PACK:-}" ] && trap 'tar czf "$PACK" --exclude=checkpoints --exclude=tb -C "$DEST" . 2>/dev/null' EXIT
[ "$NPROC" -ge 2 ] || { echo "error: needs 2 or more devices (NPROC=$NPROC)"; exit 2; }
COMMON=(-q --set logging.every=1 --set eval_every=0 --set checkpoint.every=0 --set checkpoint.save_final=false
        --set schedule.warmup_steps=20 --set optimizer.lr=1e-3)

# name -> --fix of `moestack plan` (the plan file carries the layout to `moestack train --plan`); *_deferred layouts
# also set tp_grad_reduce: deferred
declare -A FIX
if [ "$NPROC" -ge 8 ]; then
  FIX=([ep8]="dp=8,ep=8,zero=1" [ep4_tp2]="tp=2,dp=4,ep=4,zero=1" [pp2_ep4_1f1b]="pp=2,dp=4,ep=4,zero=1,schedule=1f1b"
       [pp2_ep4_interleaved]="pp=2,vpp=2,dp=4,ep=4,zero=1,schedule=interleaved_1f1b" [zero3_ep8]="dp=8,ep=8,zero=3"
       [ep4_tp2_deferred]="tp=2,dp=4,ep=4,zero=1")
elif [ "$NPROC" -ge 4 ]; then
  FIX=([ep4]="dp=4,ep=4,zero=1" [ep2_tp2]="tp=2,dp=2,ep=2,zero=1" [pp2_ep2_1f1b]="pp=2,dp=2,ep=2,zero=1,schedule=1f1b"
       [zero3_ep4]="dp=4,ep=4,zero=3" [ep2_tp2_deferred]="tp=2,dp=2,ep=2,zero=1")
else
  FIX=([ep2]="dp=2,ep=2,zero=1" [tp2]="tp=2,ep=1,zero=0" [pp2_1f1b]="pp=2,ep=1,zero=0,schedule=1f1b"
       [pp2_interleaved]="pp=2,vpp=2,ep=1,zero=0,schedule=interleaved_1f1b" [zero3_ep2]="dp=2,ep=2,zero=3"
       [tp2_deferred]="tp=2,ep=1,zero=0")
fi

CAL=()
if [ -n "${CALIBRATION:-}" ]; then  # reuse the calibration of an earlier call on the same kind of GPU
  CAL=(--calibration "$CALIBRATION")
elif [ "$DEVICE" = cuda ]; then  # the planner's efficiencies and part factors measured on this GPU first
  $PY -m moestack tune "$MODEL" --out "$DEST/calibration.json" ${MEASURE_HOST:+--measure-host} > "$DEST/tune.log" 2>&1 \
    && CAL=(--calibration "$DEST/calibration.json") || echo "| tune | failed: $(tail -1 "$DEST/tune.log") |"
fi
# collective bus bandwidth / latency measured on these NPROC ranks (NCCL on cuda, gloo at small sizes on cpu), merged
# as `comm` into a calibration in $DEST (a copy of CALIBRATION when given; the default calibration when none): the
# planner prices tier-0 collectives with it instead of the datasheet NVLink bandwidth (tune/comm.py)
COMM_ARGS=(--sizes-mib 1,16,128 --iters 20)
[ "$DEVICE" = cuda ] || COMM_ARGS=(--sizes-mib 0.0625,0.25,1 --iters 5)
rm -f "$DEST/tune_comm.json"
COMM_CAL="$DEST/calibration.json"
if [ -n "${CALIBRATION:-}" ]; then  # never modify the given file: merge into a copy
  COMM_CAL="$DEST/calibration_comm.json"
  cp "$CALIBRATION" "$COMM_CAL"
elif [ ${#CAL[@]} -eq 0 ]; then  # no tune ran (cpu) or it failed: the default calibration is the base
  rm -f "$COMM_CAL"
fi
# NCCL's INFO lines say which transport each peer pair got (P2P/CUMEM, P2P/IPC, SHM, NET): on the x2 VM (session 5)
# every collective ran the LL protocol at ~20 GB/s, suspected to be SHM without GPU peer-to-peer
if [ "${TUNE_COMM:-1}" = 0 ]; then
  echo "| tune-comm | skipped (TUNE_COMM=0) |"
elif NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM \
  $PY -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m moestack tune-comm \
  --out "$DEST/tune_comm.json" --merge-into "$COMM_CAL" "${COMM_ARGS[@]}" > "$DEST/tune_comm.log" 2>&1; then
  CAL=(--calibration "$COMM_CAL")
  grep "^| tune-comm" "$DEST/tune_comm.log"
else
  echo "| tune-comm | failed: $(grep -m1 -i error "$DEST/tune_comm.log" | cut -c1-160) |"
fi
[ "$DEVICE" = cuda ] && [ "${TUNE_COMM:-1}" != 0 ] && echo "| nccl transport | $(grep -o -E 'via [A-Za-z/0-9]+' "$DEST/tune_comm.log" | sort | uniq -c \
  | tr -s ' ' | tr '\n' ';') |"

plan() {  # plan NAME DEVICES FIX -> $DEST/plan_NAME.yaml (with the planner's prediction inside)
  $PY -m moestack plan "$MODEL" --cluster "$CLUSTER" --devices "$2" --seq-len "$SEQ" "${CAL[@]}" \
    --global-batch-tokens $((GBS * SEQ)) --fix "$3" --out "$DEST/plan_$1.yaml" > "$DEST/plan_$1.log" 2>&1 \
    || { echo "| $1 | plan failed: $(tail -1 "$DEST/plan_$1.log") |"; return 1; }
  # *_deferred: the same layout with the TP gradient sums once per step (plan.tp_grad_reduce, parallel/README.md)
  [[ "$1" == *_deferred ]] && echo "tp_grad_reduce: deferred" >> "$DEST/plan_$1.yaml"
  return 0
}

train() {  # train NAME NPROC STEPS
  local log="$DEST/train_$1.log" prof=()
  [[ ",${PROFILE:-}," == *",$1,"* ]] && prof=(--profile-steps 6:9)
  [[ ",${PHASE_PEAKS:-}," == *",$1,"* ]] && prof+=(--set phase_peaks_step=10)
  rm -rf "$DEST/run_$1"
  if [ "$2" -eq 1 ]; then
    $PY -m moestack train --plan "$DEST/plan_$1.yaml" --out "$DEST/run_$1" --steps "$3" "${COMMON[@]}" "${prof[@]}" \
      > "$log" 2>&1
  else
    $PY -m torch.distributed.run --standalone --nproc-per-node "$2" -m moestack train --plan "$DEST/plan_$1.yaml" \
      --out "$DEST/run_$1" --steps "$3" "${COMMON[@]}" "${prof[@]}" > "$log" 2>&1
  fi || echo "| $1 | train failed: $(grep -m1 -i error "$log" | cut -c1-160) |"
}

if [[ " $PHASES " == *" layouts "* ]]; then
  echo "== layouts ($NPROC ranks, $MODEL, $STEPS steps, global batch $GBS x $SEQ)"
  if [ -n "${SINGLE_FROM:-}" ] && [ -f "$SINGLE_FROM/run_single/metrics.jsonl" ]; then
    [ "$(cd "$SINGLE_FROM" && pwd)" = "$(cd "$DEST" && pwd)" ] \
      || { rm -rf "$DEST/run_single"; cp -r "$SINGLE_FROM/run_single" "$SINGLE_FROM/plan_single.yaml" "$DEST/"; }
    echo "single: reused from $SINGLE_FROM"
  else
    plan single 1 "dp=1,zero=0" && train single 1 "$STEPS"
  fi
  names=()
  if [ -n "${LAYOUTS:-}" ]; then IFS=, read -r -a order <<< "$LAYOUTS"; else order=("${!FIX[@]}"); fi
  for name in "${order[@]}"; do  # in the order LAYOUTS gives (the ones a cut call loses come last)
    [ -n "${FIX[$name]:-}" ] || { [ "$name" = none ] || echo "| $name | not a layout on $NPROC devices |"; continue; }
    names+=("$name")
    plan "$name" "$NPROC" "${FIX[$name]}" && train "$name" "$NPROC" "$STEPS"
  done
  $PY scripts/multigpu_summary.py layouts "$DEST" single "${names[@]}"
fi

if [[ " $PHASES " == *" a2a "* ]]; then
  echo "== all-to-all ($NPROC ranks): moestack dispatch + combine vs raw all_to_all_single"
  if [ "$DEVICE" = cuda ]; then
    SHAPES=("k3 --tokens 8192 --width 3584 --experts 896 --top-k 16" "dsv3 --tokens 8192 --width 7168 --experts 256 --top-k 8")
  else
    SHAPES=("small")
  fi
  DISPATCHERS=("flat")
  [ "$NPROC" -ge 4 ] && DISPATCHERS+=("hierarchical --domain $((NPROC / 2))")
  for shape in "${SHAPES[@]}"; do
    tag=${shape%% *}; args=${shape#"$tag"}
    for skew in 0 1.2; do
      for disp in "${DISPATCHERS[@]}"; do
        log="$DEST/a2a_${tag}_${skew}_${disp%% *}.log"
        echo "-- $tag skew $skew ${disp}"
        # shellcheck disable=SC2086
        $PY -m torch.distributed.run --standalone --nproc-per-node "$NPROC" benchmarks/a2a.py $args --skew "$skew" \
          --dispatcher $disp > "$log" 2>&1 || echo "| a2a $tag | failed: $(tail -1 "$log" | cut -c1-160) |"
        grep "^|" "$log"
      done
    done
  done
  $PY benchmarks/a2a_order.py > "$DEST/a2a_order.log" 2>&1 || echo "| a2a order | failed |"
  grep "^|" "$DEST/a2a_order.log"
fi

if [[ " $PHASES " == *" scaling "* ]]; then
  echo "== weak scaling (fixed per-device batch)"
  names=()
  for n in 1 2 4 8; do
    [ "$n" -le "$NPROC" ] || break
    name="weak$n"
    GBS_SAVE=$GBS; GBS=$((n * 2))  # 2 sequences per device per step
    if [ "$n" -eq 1 ]; then plan "$name" 1 "dp=1,zero=0,mbs=2"; else plan "$name" "$n" "dp=$n,ep=$n,zero=1,mbs=2"; fi \
      && train "$name" "$n" "$SCALE_STEPS"
    GBS=$GBS_SAVE
    names+=("$name")
  done
  $PY scripts/multigpu_summary.py scaling "$DEST" "${names[@]}"
fi
