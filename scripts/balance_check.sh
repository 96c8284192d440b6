#!/usr/bin/env bash
# Expert balance on one GPU (issue #27's "Done when"): the proxy for STEPS steps at 4096 tokens with the defaults
# (quantile balancing, moestack/config/presets/proxy.yaml), then the K3 EP16 slice (benchmarks/configs/
# k3-ep16-slice.yaml) for K3_STEPS steps, then a per-layer table of each run's metrics.jsonl
# (scripts/balance_summary.py): worst max/mean and idle experts from step FROM (K3_FROM for the slice), the loss at
# steps 50/100/200 and a PASS/FAIL line (every layer max/mean <= 1.5, no idle expert).
# BASELINE=1 also trains the proxy with the routing of before issue #27 (the sign bias update, rate 1e-3) for the
# loss comparison: a second proxy run, so set STEPS=100 or run it as its own call.
#
# Usage on the device machine:  bash scripts/balance_check.sh [extra moestack train flags]
#   STEPS=200 K3_STEPS=20 SEQ=4096 FROM=50 K3_FROM=10 LOG_EVERY=5 OUT=runs K3_LR=2.2e-4   (defaults)
# The slice trains at K3_LR, not the TrainSpec default 3e-3 (tuned on the proxy's width 1536): at width 7168 AdamW
# at 3e-3 diverges within the warm-up (loss 27 at step 5 on the H200; a CPU copy at K3 width with 4 heads went
# 12.3 -> 37.8 by step 6), its sigmoid scores saturate and no bias can balance tied scores. 2.2e-4 is the peak
# rate DeepSeek-V3 published for the same width (benchmarks/RESULTS.md, "Expert balance").
#   ONLY=proxy | ONLY=k3          one of the two runs;  BASELINE=1 ONLY=baseline: only the old-routing proxy
#   CPU dry run: MODEL=tiny K3_MODEL=tiny SEQ=64 STEPS=12 K3_STEPS=4 FROM=4 K3_FROM=2 DEVICE=cpu bash ...
# Runtime (estimate, H200): proxy ~0.45 s per step -> ~1.5 min + ~1 min start/compile; the slice ~20 steps of ~2-3 s
# + ~1 min start: ~5 min in all (BASELINE=1 adds ~2.5 min).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh  # carried wheels, PYTHONPATH
DEST=${OUT:-runs}
STEPS=${STEPS:-200}
K3_STEPS=${K3_STEPS:-20}
SEQ=${SEQ:-4096}
FROM=${FROM:-50}
K3_FROM=${K3_FROM:-10}
LOG_EVERY=${LOG_EVERY:-5}
MODEL=${MODEL:-proxy}
K3_MODEL=${K3_MODEL:-benchmarks/configs/k3-ep16-slice.yaml}
K3_LR=${K3_LR:-2.2e-4}
ONLY=${ONLY:-all}
PY=${PYTHON:-python3}
COMMON=(--seq-len "$SEQ" -b 1 --set logging.every="$LOG_EVERY" --set eval_every=0 --set checkpoint.every=0
        --set checkpoint.save_final=false --set logging.progress=false ${DEVICE:+--device "$DEVICE"})
RUN_P=$DEST/balance_${MODEL}_s${SEQ}
RUN_K=$DEST/balance_k3slice_s${SEQ}
RUN_B=$DEST/balance_${MODEL}_sign_s${SEQ}
runs=()
t0=$SECONDS
if [ "$ONLY" = all ] || [ "$ONLY" = proxy ]; then
  rm -rf "$RUN_P"
  "$PY" -m moestack train --model "$MODEL" --steps "$STEPS" "${COMMON[@]}" --out "$RUN_P" "$@"
  echo "[$MODEL: $((SECONDS - t0)) s]"
fi
if [ "${BASELINE:-0}" = 1 ]; then  # the routing before #27: sign update at 1e-3, same everything else
  rm -rf "$RUN_B"
  mkdir -p "$DEST"
  "$PY" - "$MODEL" "$DEST/${MODEL}_sign.yaml" <<'EOF'
import sys
from moestack.config.base import dump_yaml
from moestack.planner.profile import load_any_model_spec
spec = load_any_model_spec(sys.argv[1])
router = spec.moe.router.model_copy(update={"bias_update": "sign", "bias_update_rate": 1e-3, "z_loss_coef": 0.0,
                                            "global_aux_loss_coef": 0.0, "seq_aux_loss_coef": 1e-4,
                                            "selection_jitter": 0.0})
dump_yaml(spec.model_copy(update={"name": spec.name + "-sign",
                                  "moe": spec.moe.model_copy(update={"router": router})}), sys.argv[2])
EOF
  t1=$SECONDS
  "$PY" -m moestack train --model "$DEST/${MODEL}_sign.yaml" --steps "$STEPS" "${COMMON[@]}" --out "$RUN_B" "$@"
  echo "[$MODEL, sign routing: $((SECONDS - t1)) s]"
fi
if [ "$ONLY" = all ] || [ "$ONLY" = k3 ]; then
  rm -rf "$RUN_K"
  t2=$SECONDS
  "$PY" -m moestack train --model "$K3_MODEL" --steps "$K3_STEPS" --lr "$K3_LR" "${COMMON[@]}" --out "$RUN_K" "$@"
  echo "[k3 slice: $((SECONDS - t2)) s]"
fi
echo "== expert load =="
[ -f "$RUN_P/metrics.jsonl" ] && [ "$ONLY" != k3 ] && [ "$ONLY" != baseline ] && \
  "$PY" scripts/balance_summary.py "$RUN_P" --from-step "$FROM" --loss-steps 50 100 "$STEPS"
[ -f "$RUN_B/metrics.jsonl" ] && [ "${BASELINE:-0}" = 1 ] && \
  "$PY" scripts/balance_summary.py "$RUN_B" --from-step "$FROM" --loss-steps 50 100 "$STEPS"
[ -f "$RUN_K/metrics.jsonl" ] && { [ "$ONLY" = all ] || [ "$ONLY" = k3 ]; } && \
  "$PY" scripts/balance_summary.py "$RUN_K" --from-step "$K3_FROM" --loss-steps 5 10 "$K3_STEPS"
echo "[total $((SECONDS - t0)) s]"
