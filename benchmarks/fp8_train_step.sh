#!/usr/bin/env bash
# Training-step throughput, bf16 vs the FP8 recipe (`--precision fp8`, moestack/ops/fp8/convert.py), same model, data and
# seed: ROUNDS interleaved runs of STEPS steps each; prints per run the losses and the median tokens/s over steps
# >= 5 (earlier steps compile and autotune), then the ratio of the medians. Default model: two Kimi K3 layers at full
# width with an EP16 rank's 56 experts (benchmarks/configs/k3-ep16-slice.yaml; ~90 GiB peak on one H200).
# Usage on the device machine:  bash benchmarks/fp8_train_step.sh   [MODEL=... SEQ=4096 B=1 STEPS=14 ROUNDS=2 OUT=/tmp]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MODEL=${MODEL:-benchmarks/configs/k3-ep16-slice.yaml}
SEQ=${SEQ:-4096}
B=${B:-1}
STEPS=${STEPS:-14}
ROUNDS=${ROUNDS:-2}
DEST=${OUT:-/tmp}
PY=${PYTHON:-python3}
for round in $(seq "$ROUNDS"); do
  for prec in bf16 fp8; do
    run=$DEST/fp8step_${prec}_$round
    rm -rf "$run"
    "$PY" -m moestack train --model "$MODEL" --seq-len "$SEQ" -b "$B" --steps "$STEPS" --precision "$prec" \
      --set logging.every=1 --set eval_every=0 --set checkpoint.every=0 --set checkpoint.save_final=false \
      --set logging.progress=false --set logging.tensorboard=false --set schedule.warmup_steps=4 \
      --set optimizer.lr=3e-4 --out "$run" > "$run.log" 2>&1 || { echo "$prec round $round failed: $run.log"; exit 1; }
  done
done
"$PY" - "$DEST" "$ROUNDS" <<'PY'
import json, statistics, sys
dest, rounds = sys.argv[1], int(sys.argv[2])
med = {"bf16": [], "fp8": []}
for r in range(1, rounds + 1):
    for prec in ("bf16", "fp8"):
        rows = [json.loads(l) for l in open(f"{dest}/fp8step_{prec}_{r}/metrics.jsonl")]
        tr = [x for x in rows if x.get("train/loss") is not None]
        tps = [x["train/tokens_per_s"] for x in tr if x["step"] >= 5]
        med[prec].append(statistics.median(tps))
        peak = max(x.get("train/peak_mem_gib", 0.0) for x in tr)
        print(f"{prec} round {r}: tokens/s median {med[prec][-1]:,.0f} (range {min(tps):,.0f}-{max(tps):,.0f}), "
              f"peak {peak:.1f} GiB, losses {[round(x['train/loss'], 3) for x in tr]}")
print(f"FP8_TRAIN_STEP fp8/bf16 = {statistics.median(med['fp8']) / statistics.median(med['bf16']):.3f}x "
      f"(medians of {rounds} rounds: bf16 {statistics.median(med['bf16']):,.0f}, fp8 {statistics.median(med['fp8']):,.0f})")
PY
