"""`moestack tune-comm` (tune/comm.py) on 2 gloo ranks, merging its result into a calibration, and the cost
model's collective times with a measured `comm` calibration (tier-0 groups) against the hand formula."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moestack.config.base import ConfigError
from moestack.config.cluster import load_cluster_spec
from moestack.planner.calibration import COLLECTIVE_KINDS, CommCalibration, load_calibration
from moestack.planner.cost.comm import a2a_time, ring_time
from moestack.tune.comm import busbw_factor, fit_latency, merge_into, run_tune_comm

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "parallel"))
from _dist import run_ranks  # noqa: E402 (importable only after the sys.path insert above)


def _tune_worker(rank: int, world_size: int, out: str) -> dict | None:
    return run_tune_comm(Path(out), sizes_mib=[1 / 16, 1 / 4], iters=3, warmup=1)


def test_tune_comm_on_two_gloo_ranks_writes_busbw_and_merges(tmp_path):
    out = tmp_path / "comm.json"
    results = run_ranks(__file__, "_tune_worker", world_size=2, timeout=120, out=str(out))
    assert results[1] is None  # rank 0 writes
    data = json.loads(out.read_text())
    assert data == results[0]
    assert data["world"] == 2 and data["backend"] == "gloo" and data["device"] and data["date"]
    assert set(data["collectives"]) == set(COLLECTIVE_KINDS)
    for kind, c in data["collectives"].items():
        assert c["busbw_gb_s"] > 0 and c["latency_us"] >= 0, kind
        (b0, t0), (b1, t1) = c["points"]
        assert b0 == 2**16 and b1 == 2**18 and t0 > 0 and t1 > 0
        assert c["busbw_gb_s"] == pytest.approx(busbw_factor(kind, 2) * b1 / t1 / 1e9)
    # merge into a copy of the default calibration: loads, `comm` set, the rest unchanged
    cal_path = tmp_path / "cal.json"
    base = load_calibration()
    cal_path.write_text(json.dumps(base.model_dump(mode="json")))
    merge_into(cal_path, data, str(out))
    cal = load_calibration(cal_path)
    assert cal.comm is not None and cal.comm.world == 2 and cal.comm.tier == 0 and cal.comm.backend == "gloo"
    assert cal.comm.collectives["a2a"].busbw_gb_s == pytest.approx(data["collectives"]["a2a"]["busbw_gb_s"])
    assert cal.model_copy(update={"comm": None}) == base
    assert not list(tmp_path.glob(".*tmp*"))  # the atomic write leaves no temporary behind


def test_merge_cli_from_file_and_bad_file(tmp_path):
    from moestack.cli.app import main

    data = {"world": 2, "backend": "nccl", "device": "H200", "date": "d",
            "collectives": {k: {"busbw_gb_s": 20.0, "latency_us": 30.0, "points": []} for k in COLLECTIVE_KINDS}}
    src = tmp_path / "comm.json"
    src.write_text(json.dumps(data))
    cal_path = tmp_path / "new_cal.json"  # missing: the default calibration is the base
    assert main(["tune-comm", "--from", str(src), "--merge-into", str(cal_path)]) == 0
    assert load_calibration(cal_path).comm.collectives["rs"].busbw_gb_s == 20.0
    data["collectives"]["ar"]["busbw_gb_s"] = -1.0
    src.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="busbw_gb_s"):
        merge_into(cal_path, data)
    assert load_calibration(cal_path).comm.collectives["ar"].busbw_gb_s == 20.0  # untouched on failure


def test_without_torchrun_one_line_error(monkeypatch, capsys, tmp_path):
    from moestack.cli.app import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert main(["tune-comm", "--out", str(tmp_path / "x.json")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "torchrun" in lines[0], lines
    assert not (tmp_path / "x.json").exists()


def test_fit_latency():
    a, b = fit_latency([(1e6, 1e-4 + 1e6 / 20e9), (1e8, 1e-4 + 1e8 / 20e9)])
    assert a == pytest.approx(1e-4) and b == pytest.approx(1 / 20e9)
    a, b = fit_latency([(1e6, 1e-3), (1e8, 1e-3 + 1e8 / 20e9)])
    assert a == pytest.approx(1e-3 - 1e6 * 5e-3 / 99e6)
    a, b = fit_latency([(1e6, 2e-3), (1e8, 1e-3)])  # decreasing: no negative slope, a = 0 through the origin
    assert a == 0.0 and b > 0
    assert fit_latency([(1e6, 1e-3)]) == (0.0, pytest.approx(1e-9))


COMM = CommCalibration(world=2, collectives={k: {"busbw_gb_s": 20.0, "latency_us": 50.0} for k in COLLECTIVE_KINDS})


def test_collective_times_with_measured_comm():
    cl = load_cluster_spec("h200-cluster").with_devices(16)  # 8 GPUs per NVLink node (tier 0), 2 nodes
    nv = cl.tiers[0]
    S, bw, lat = 100e6, 20e9, 50e-6
    for kind, factor in (("rs", 1.0), ("ag", 1.0), ("ar", 2.0)):
        for size in (2, 8):
            got = ring_time(cl, S, size, 1, kind, COMM)
            assert got == pytest.approx(factor * (size - 1) / size * S / bw + lat)
            # without comm: the datasheet path, unchanged
            assert ring_time(cl, S, size, 1, kind) == pytest.approx(
                factor * (size - 1) / size * S / (nv.bandwidth_gb_s * 1e9 * nv.efficiency)
                + (size - 1) * factor * nv.latency_us * 1e-6)
            assert ring_time(cl, S, size, 1, kind, None) == ring_time(cl, S, size, 1, kind)
        # a group crossing nodes (tier 1) keeps the datasheet bandwidth
        assert ring_time(cl, S, 2, 8, kind, COMM) == ring_time(cl, S, 2, 8, kind)
    for size in (2, 8):
        assert a2a_time(cl, S, size, 1, False, 8, comm=COMM) == pytest.approx((size - 1) / size * S / bw + lat)
        assert a2a_time(cl, S, size, 1, False, 8) == pytest.approx(
            (size - 1) / size * S / (nv.bandwidth_gb_s * 1e9 * nv.efficiency) + 2 * nv.latency_us * 1e-6)
    assert a2a_time(cl, S, 16, 1, True, 8, comm=COMM) == a2a_time(cl, S, 16, 1, True, 8)
    # a kind the measurement lacks keeps the datasheet
    only_a2a = CommCalibration(world=2, collectives={"a2a": {"busbw_gb_s": 20.0}})
    assert ring_time(cl, S, 2, 1, "rs", only_a2a) == ring_time(cl, S, 2, 1, "rs")
    assert ring_time(cl, 0, 2, 1, "rs", COMM) == 0.0 and a2a_time(cl, S, 1, 1, False, 8, comm=COMM) == 0.0


def test_plan_step_time_follows_measured_comm(tmp_path):
    """ep2 on 2 H200s: a 20 GB/s measured calibration makes the predicted step slower; without comm unchanged."""
    from moestack.planner.calibration import save_calibration
    from moestack.planner.search import Planner, load_problem, parse_fix

    def step(cal_comm):
        path = tmp_path / "cal.json"
        save_calibration(load_calibration().model_copy(update={"comm": cal_comm}), path)
        problem = load_problem("proxy", "h200-cluster", 2, 4096, 16 * 4096, calibration=path)
        best = Planner(problem).search(parse_fix("dp=2,ep=2,zero=1"), require_fit=False).best
        return best.step_time_s

    base = step(None)
    slow = step(COMM)
    assert slow > base * 1.02
    assert step(None) == base
