#!/usr/bin/env bash
# Foundation baseline on one H200: the proxy preset with the reference (pure PyTorch) KDA/DSA ops and torch grouped_mm.
# Usage on the device machine: bash scripts/proxy_baseline.sh [extra moestack train flags]
# Prints the last metrics lines; metrics.jsonl and loss.png go to ${OUT:-runs}/proxy_*.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
DEST=${OUT:-runs}
STEPS=${STEPS:-150}
SEQ=${SEQ:-4096}
BS=${BS:-2}
MODE=${MODE:-dense}
RUN=$DEST/proxy_${MODE}_s${SEQ}_b${BS}
KDA=${KDA:-reference}  # kernels.kda.backend
python3 -m moestack train --model proxy --seq-len "$SEQ" -b "$BS" --steps "$STEPS" --dsa-mode "$MODE" \
  --set kernels.kda.backend="$KDA" --out "$RUN" --set logging.every=10 --set eval_every=0 --set checkpoint.every=0 --set logging.progress=true \
  --set schedule.warmup_steps=20 --set optimizer.lr=1e-3 "$@"
python3 - "$RUN/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
train = [r for r in rows if "train/loss" in r]
tail = train[len(train) // 3:]  # skip warm-up / compilation steps
tps = statistics.median(r["train/tokens_per_s"] for r in tail)
mfu = [r["train/mfu"] for r in tail if r.get("train/mfu") is not None]
mem = max(r.get("train/peak_mem_gib", 0) for r in train)
print(f"SUMMARY steps={train[-1]['step']} loss {train[0]['train/loss']:.3f}->{train[-1]['train/loss']:.3f} "
      f"tokens/s(median)={tps:,.0f} mfu={statistics.median(mfu) * 100 if mfu else float('nan'):.2f}% "
      f"peak_mem={mem:.1f}GiB")
PY
