#!/usr/bin/env bash
# One device call: adapt Kimi K3 to one H200 and train the proxy it yields, then the hand-made proxy preset with the
# default CUDA backends (Triton KDA). Each run is time-boxed; metrics are logged every 5 steps so a cut run still
# reports. Usage (device machine): bash scripts/gpu_session_k3fit.sh
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
DEST=${OUT:-runs}
summary() {
python3 - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"train/loss"' in l]
if not rows:
    sys.exit(print(sys.argv[1], "no steps logged"))
tail = rows[1:] or rows
tps = statistics.median(r["train/tokens_per_s"] for r in tail)
mfu = statistics.median(r.get("train/mfu", float("nan")) for r in tail)
mem = max(r.get("train/peak_mem_gib", 0) for r in rows)
print(f"SUMMARY {sys.argv[1]} steps={rows[-1]['step']} loss {rows[0]['train/loss']:.3f}->{rows[-1]['train/loss']:.3f}"
      f" tokens/s={tps:,.0f} mfu={mfu * 100:.2f}% peak_mem={mem:.1f}GiB")
PY
}
python3 -m moestack adapt kimi-k3 --fit h200 --out "$DEST/k3fit.yaml" | tail -4
common=(--set logging.every=5 --set eval_every=0 --set checkpoint.every=0 --set schedule.warmup_steps=10
        --set optimizer.lr=1e-3 -q)
timeout "${T1:-150}" python3 -m moestack train --model "$DEST/k3fit.yaml" --seq-len 4096 -b 2 --steps 40 \
  --out "$DEST/k3fit_run" "${common[@]}" 2>&1 | tail -3
summary "$DEST/k3fit_run/metrics.jsonl"
timeout "${T2:-150}" python3 -m moestack train --model proxy --seq-len 4096 -b 1 --steps 60 \
  --out "$DEST/proxy_run" "${common[@]}" 2>&1 | tail -3
summary "$DEST/proxy_run/metrics.jsonl"
