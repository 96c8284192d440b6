"""Planner vs measured on one GPU: predicted step time and peak memory against a real training step.

    python3 benchmarks/planner_measured.py --calibration cal.json          # the default grid on the proxy model
    python3 benchmarks/planner_measured.py --grid 1x2048:none,2x4096:full  # micro-batch x seq : recompute
    python3 benchmarks/planner_measured.py --model tiny --device cpu --grid 1x64:none --steps 1   # smoke test

For each (micro-batch, sequence length, recompute) point: build the model as the trainer does (benchmarks/memory.py
`run`: bf16 autocast, fp32 weights, AdamW, clipping, router bias update), time `--steps` steps after `--warmup`
(median), read the allocator peak (torch.cuda.max_memory_allocated; compared with the planner's total minus its
"reserved" term, the CUDA context and allocator slack the allocator does not count), and evaluate the same Plan with the cost model (moestack/planner/cost/) under
the given calibration (run `moestack tune MODEL --out cal.json` first so the KDA / sparse-attention / GEMM
efficiencies are the ones of the backends this process runs). Prints one markdown row per point and the errors;
issue #4 asks for |time error| <= 10% and |memory error| <= 5%.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from moestack.config.cluster import load_cluster_spec
from moestack.config.model_spec import load_model_spec
from moestack.planner.calibration import load_calibration
from moestack.planner.cost.step import CostModel
from moestack.planner.profile import profile_model

GIB = 2**30
DEFAULT_GRID = "1x2048:none,1x4096:none,2x2048:none,1x4096:selective,1x4096:full,2x4096:full,1x8192:full"


def _memory_bench():
    """benchmarks/memory.py as a module (the build-and-train step is shared, not repeated here)."""
    spec = importlib.util.spec_from_file_location("memory_bench", Path(__file__).with_name("memory.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_grid(text: str) -> list[tuple[int, int, str]]:
    points = []
    for item in text.split(","):
        try:
            shape, mode = item.split(":")
            mbs, seq = (int(x) for x in shape.split("x"))
        except ValueError:
            raise SystemExit(f"error: --grid item {item!r} is not MBSxSEQ:RECOMPUTE (e.g. 1x4096:full)") from None
        if mode not in ("none", "selective", "full"):
            raise SystemExit(f"error: --grid item {item!r}: recompute must be none, selective or full")
        points.append((mbs, seq, mode))
    return points


def predict(spec, plan, cal) -> tuple[float, float, dict]:
    cluster = load_cluster_spec(plan.cluster).with_devices(plan.devices)
    prof = profile_model(spec, plan.seq_len)
    flops = prof.train_flops_per_token + prof.mtp_train_flops_per_token
    cost = CostModel(spec, cluster, cal, plan.seq_len, flops).evaluate(plan)
    # the allocator peak excludes the CUDA context / NCCL / allocator slack the planner adds as "reserved"
    allocated = cost.memory_total - cost.memory.get("reserved", 0.0)
    return cost.step_time_s, allocated, {"time": cost.time, "memory": cost.memory}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="proxy")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--calibration", default=None, help="calibration JSON from `moestack tune` (default: built-in)")
    ap.add_argument("--grid", default=DEFAULT_GRID)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bench = _memory_bench()
    device = torch.device(args.device)
    cal = load_calibration(args.calibration)
    base = load_model_spec(args.model)
    cluster = "h200-1gpu" if device.type == "cuda" else "cpu"
    rows = []
    print("| mbs x seq | recompute | measured s | planner s | time error | measured GiB | planner GiB | memory error |")
    print("|---|---|---|---|---|---|---|---|")
    for mbs, seq, mode in parse_grid(args.grid):
        spec = base.model_copy(update={"max_seq_len": max(base.max_seq_len, seq)})
        fields = {} if mode == "none" else {"recompute": mode}
        plan = bench.make_plan(args.model, seq, mbs, fields, cluster)
        t_pred, m_pred, detail = predict(spec, plan, cal)
        r = bench.run(f"{mbs}x{seq}:{mode}", spec, plan, device, args.steps, args.warmup, report=True)
        r.update(predicted_s=t_pred, predicted_gib=m_pred / GIB, predicted_detail=detail)
        rows.append(r)
        if r["oom"]:
            print(f"| {mbs}x{seq} | {mode} | out of memory | {t_pred:.3f} | - | - | {m_pred / GIB:.1f} | - |", flush=True)
            continue
        peak = r.get("peak_gib")
        t_err = 100 * (t_pred / r["step_s"] - 1)
        m_err = f"{100 * (m_pred / GIB / peak - 1):+.1f}%" if peak else "-"
        peak_s = f"{peak:.1f}" if peak else "-"
        print(f"| {mbs}x{seq} | {mode} | {r['step_s']:.3f} | {t_pred:.3f} | {t_err:+.1f}% | {peak_s} | "
              f"{m_pred / GIB:.1f} | {m_err} |", flush=True)
    for r in rows:
        if r.get("report_lines"):
            print(f"\n{r['technique']}: planner time {json.dumps({k: round(v, 4) for k, v in r['predicted_detail']['time'].items()})}")
            print("\n".join(r["report_lines"]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
