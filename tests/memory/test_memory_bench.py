"""benchmarks/memory.py: the table reports OOM / failed / timed-out / skipped rows, and a row that crashes in its
own process is reported without stopping the phase."""

from __future__ import annotations

import argparse


def test_rows_and_table_report_failures(bench):
    """benchmarks/memory.py: OOM, failed, timed-out and skipped rows are reported as such; saved / time added are
    taken against the baseline, else the reference row."""
    rows = [
        {"technique": "baseline", "experts": 128, "seq": 16384, "oom": True, "status": "oom",
         "predicted": {"alloc_gib": 150.0}},
        {"technique": "recompute full", "experts": 128, "seq": 16384, "oom": False, "status": "ok", "peak_gib": 60.0,
         "step_s": 1.0, "predicted": {"alloc_gib": 63.0}},
        {"technique": "muon", "experts": 128, "seq": 16384, "oom": False, "status": "ok", "peak_gib": 100.0,
         "step_s": 1.5, "predicted": {"alloc_gib": 95.0}},
        {"technique": "expert offload", "experts": 128, "seq": 16384, "oom": False, "status": "failed",
         "error": "exit 1: RuntimeError: CUDA error"},
        {"technique": "optimizer offload", "experts": 128, "seq": 16384, "oom": False, "status": "timeout"},
        {"technique": "all combined", "experts": 128, "seq": 16384, "oom": False, "status": "skipped",
         "error": "no time left"},
    ]
    lines = bench.table(rows, "recompute full", 140.4)
    assert all(x.startswith("|") for x in lines)
    body = lines[2:]
    assert "out of memory (140 GiB)" in body[0] and "150.0" in body[0]
    assert "| 60.0 | - | 1.00 | - | 63.0 | +5.0% | 0.952 |" in body[1]
    assert "| 100.0 | -40.0 | 1.50 | +50% | 95.0 | -5.0% | 1.053 |" in body[2]
    assert "failed: exit 1: RuntimeError: CUDA error" in body[3]
    assert "timed out" in body[4] and "skipped (no time left)" in body[5]
    assert bench.reference_row(rows, "recompute full") is rows[1]
    assert bench.reference_row(rows, "first") is rows[1]


def test_isolated_row_crash_is_a_failed_row(bench):
    """A child that dies (here: a plan field the Plan rejects) becomes a "failed" row with its error line."""
    args = argparse.Namespace(model="tiny", device="cpu", cluster="cpu", micro_batch=1, steps=1, warmup=0,
                              no_report=True, calibration=None)
    row = {"name": "bad", "fields": {"optimizer": "sgd"}, "seq": 16, "experts": None}
    r = bench.run_isolated(row, args, timeout_s=300)
    assert r["status"] == "failed" and not r["oom"], r
    assert r["error"].startswith("exit 1:") and "optimizer" in r["log_tail"]
    line = bench.row_line(dict(r, predicted={}), None, None)
    assert line.startswith("| bad | None | 16 | failed: exit 1:")


def test_details_report_offload_overlap(bench):
    """The activation-offload line: copy time per step, and the overlap when the reference is the same step
    without offload."""
    plan = {"recompute": {"kda": "none"}, "offload": {"activations": False}}
    ref = {"technique": "baseline", "experts": 128, "seq": 4096, "status": "ok", "step_s": 1.0, "plan": plan}
    row = {"technique": "activation offload", "experts": 128, "seq": 4096, "status": "ok", "step_s": 1.5,
           "offload_copy_s": 2.0, "plan": dict(plan, offload={"activations": True})}
    text = "\n".join(bench._details([ref, row], ref))
    assert "copies 2.00 s per step" in text and "exposed 0.50 s vs baseline: overlap 75%" in text
    other = dict(ref, plan=dict(plan, recompute={"kda": "full"}))
    assert "overlap" not in "\n".join(bench._details([other, row], other))


def test_host_estimate_rounds_pinned_tensors_to_powers_of_two(bench):
    """The largest phase's host estimate: 14 B per expert parameter, each pinned tensor rounded up to a power of two
    (torch's caching host allocator), plus 12 B per other parameter with optimizer offload."""
    from moestack.config.model_spec import load_model_spec

    assert [bench._pinned(n) for n in (1, 4096, 4097, 3 << 20)] == [1, 4096, 8192, 4 << 20]
    base = load_model_spec("proxy")
    need = {e: bench.host_bytes_needed(bench.variant_spec(base, 16384, e), bench.ALL) / 1e9 for e in (128, 192, 256)}
    assert 50 < need[128] < 60 and 90 < need[256] < 100 and need[192] > 0.9 * need[256]  # 192: rounded up
    experts_only = bench.host_bytes_needed(bench.variant_spec(base, 16384, 128), {"offload": ["experts"]})
    assert experts_only < need[128] * 1e9


def test_largest_search_down_stops_at_first_trained(bench, tmp_path, monkeypatch):
    """--search down: rows in the given order, host-infeasible ones skipped, the first that trains ends it."""
    import json
    import sys

    out = tmp_path / "rows.json"
    argv = ["memory.py", "--phase", "largest", "--search", "down", "--experts", "16,8", "--seq-lens", "",
            "--model", "tiny", "--device", "cpu", "--seq-len", "32", "--steps", "1", "--warmup", "0", "--no-report",
            "--no-isolate", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    rows = json.loads(out.read_text())
    assert [(r["experts"], r["status"]) for r in rows] == [(16, "ok"), (8, "skipped")]
    assert rows[1]["error"] == "a larger one trained" and rows[0]["clip_opt_s"] and rows[0]["host_peak_rss_gib"] > 0
    monkeypatch.setattr(sys, "argv", argv + ["--host-fraction", "1e-12"])
    bench.main()
    rows = json.loads(out.read_text())
    assert all(r["status"] == "skipped" and r["error"].startswith("host memory") for r in rows)


def test_snapshot_flag_parses_and_reaches_the_child(bench):
    """--snapshot (CUDA only; opt-in): off by default, bare flag = the current folder, passed on to row children."""
    ap = bench.build_parser()
    assert ap.parse_args([]).snapshot is None
    assert ap.parse_args(["--snapshot"]).snapshot == "."
    args = ap.parse_args(["--snapshot", "snaps", "--device", "cpu"])
    assert args.snapshot == "snaps"
    args.cluster = "cpu"
    argv = bench._child_argv(args, {"name": "x", "fields": {}, "seq": 16, "experts": None}, "out.json")
    assert argv[argv.index("--snapshot") + 1] == "snaps"
    args.snapshot = None
    assert "--snapshot" not in bench._child_argv(args, {"name": "x"}, "out.json")


def test_peak_blocks_replays_the_allocator_trace(bench):
    """The live blocks at the peak of a synthetic _snapshot() trace (only entries from `start` count for the peak)."""
    import torch

    fr = lambda name: [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},  # noqa: E731
                       {"filename": f"/repo/{name}.py", "line": 7, "name": name}]
    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": fr("weights")},
             {"action": "alloc", "addr": 2, "size": 500, "frames": fr("build_tmp")},
             {"action": "free_completed", "addr": 2, "size": 500},  # index 2: peak 600 before `start`
             {"action": "alloc", "addr": 3, "size": 300, "frames": fr("loss")},
             {"action": "alloc", "addr": 4, "size": 50, "frames": fr("grad")},
             {"action": "free_requested", "addr": 3, "size": 300},  # not yet counted as freed
             {"action": "free_completed", "addr": 3, "size": 300},
             {"action": "alloc", "addr": 5, "size": 10, "frames": fr("late")}]
    snap = {"device_traces": [trace]}
    out = bench.peak_blocks(snap, torch.device("cuda", 0), start=3)
    assert out["peak_gib"] * bench.GIB == 450 and out["trace_index"] == 4
    assert [b["bytes"] for b in out["blocks"]] == [300, 100, 50]
    assert out["blocks"][0]["frames"] == ["loss.py:7:loss"]  # torch's own frames left out
    assert bench.peak_blocks(snap, torch.device("cuda", 0), start=0)["peak_gib"] * bench.GIB == 600
