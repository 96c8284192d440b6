"""scripts/gpu_parts.py (the partitioner and the result table behind scripts/gpu_check.sh), on CPU: every test in
exactly one part, every part within its budget, greedy balance, large files cut, serial files apart; the table
from junit files (both junit families) and from a pytest log cut short."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "gpu_parts.py"
_spec = importlib.util.spec_from_file_location("gpu_parts", _PATH)
gp = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_parts", gp)  # dataclasses look their module up by name
_spec.loader.exec_module(gp)


def _suite() -> tuple[list[str], gp.Config]:
    """Files of uneven sizes: one larger than a part, one serial, one with unmeasured tests."""
    ids, tests = [], {}
    sizes = {"tests/ops/test_big.py": [40.0] * 20, "tests/ops/test_mid.py": [25.0] * 6, "tests/ops/test_small.py":
             [3.0] * 5, "tests/memory/test_mem.py": [30.0] * 3, "tests/ops/test_new.py": [None] * 4}
    for file, secs in sizes.items():
        for i, s in enumerate(secs):
            nodeid = f"{file}::test_{i}[p{i % 2}]"
            ids.append(nodeid)
            if s is not None:
                tests[nodeid] = s
    cfg = gp.Config(default_s=10.0, warmup_s=60.0, budget_s=300.0, serial=["tests/memory/test_mem.py"], tests=tests)
    return ids, cfg


@pytest.mark.parametrize("jobs", [1, 4])
def test_every_test_once_and_every_part_within_budget(jobs):
    ids, cfg = _suite()
    parts = gp.partition(ids, cfg, jobs)
    got = [n for p in parts for u in p.units for n in u.nodeids]
    assert sorted(got) == sorted(ids)
    assert all(p.estimate(cfg, jobs) <= cfg.budget_s for p in parts), [p.estimate(cfg, jobs) for p in parts]
    # lower bound on the part count: the work over the room a part has after its warmup
    work = sum(cfg.seconds(n) for n in ids if not cfg.is_serial(gp.file_of(n))) / (jobs * gp.XDIST_EFFICIENCY
                                                                                  if jobs > 1 else 1)
    work += sum(cfg.seconds(n) for n in ids if cfg.is_serial(gp.file_of(n)))
    assert len(parts) >= work / (cfg.budget_s - cfg.warmup_s)
    # greedy balance: no part is emptier than the fullest by more than the largest unit
    loads = [p.estimate(cfg, jobs) - cfg.warmup_s for p in parts]
    largest = max(u.seconds for p in parts for u in p.units)
    assert max(loads) - min(loads) <= largest
    assert gp.partition(ids, cfg, jobs) == parts  # deterministic: `list` and `run` agree


def test_large_files_are_cut_serial_files_kept_apart_and_defaults_used():
    ids, cfg = _suite()
    parts = gp.partition(ids, cfg, 1)
    units = [u for p in parts for u in p.units]
    big = [u for u in units if u.file == "tests/ops/test_big.py"]
    assert len(big) >= 4 and all(u.seconds <= cfg.budget_s - cfg.warmup_s for u in big)  # 800 s cut into runs
    big.sort(key=lambda u: ids.index(u.nodeids[0]))  # each a contiguous run, in collection order
    assert [n for u in big for n in u.nodeids] == [n for n in ids if n.startswith("tests/ops/test_big.py")]
    assert {u.serial for u in units if u.file == "tests/memory/test_mem.py"} == {True}
    assert not any(u.serial for u in units if u.file != "tests/memory/test_mem.py")
    new = next(u for u in units if u.file == "tests/ops/test_new.py")
    assert new.seconds == 4 * cfg.default_s
    mem_part = next(p for p in parts if any(u.serial for u in p.units))
    assert all(n.startswith("tests/memory/") for n in mem_part.nodeids(serial=True))
    assert fewer_with_xdist(ids, cfg)


def fewer_with_xdist(ids, cfg) -> bool:
    return len(gp.partition(ids, cfg, 8)) < len(gp.partition(ids, cfg, 1))


def test_a_test_longer_than_the_budget_still_gets_a_part():
    cfg = gp.Config(default_s=5.0, warmup_s=60.0, budget_s=300.0, tests={"tests/a.py::slow": 900.0})
    parts = gp.partition(["tests/a.py::slow", "tests/a.py::quick", "tests/b.py::x"], cfg, 1)
    assert sorted(n for p in parts for u in p.units for n in u.nodeids) == sorted(
        ["tests/a.py::slow", "tests/a.py::quick", "tests/b.py::x"])
    assert gp.partition([], cfg) == []


def test_commands_split_xdist_and_serial(tmp_path):
    ids, cfg = _suite()
    part = next(p for p in gp.partition(ids, cfg, 4) if any(u.serial for u in p.units))
    cmds = gp.pytest_commands(part, 2, tmp_path, "python3", jobs=4, timeout=300, timeout_plugin=True, xdist=True)
    assert [c[2].name for c in cmds] == ["part2_xdist.xml", "part2_serial.xml"]
    (xd, xd_ids, _), (se, se_ids, _) = cmds
    assert "-n" in xd and xd[xd.index("-n") + 1] == "4" and "-n" not in se and "no:xdist" in se
    assert xd[-len(xd_ids):] == xd_ids and se[-len(se_ids):] == se_ids
    assert "--timeout" in xd and xd[xd.index("--timeout") + 1] == "300"
    plain = gp.pytest_commands(part, 2, tmp_path, "python3", jobs=4, timeout=300, timeout_plugin=False, xdist=False)
    assert all("-n" not in c and "--timeout" not in c for c, _, _ in plain)


_XUNIT1 = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.ops.test_kda_gated_norm" file="tests/ops/test_kda_gated_norm.py" name="test_gpu_bf16[silu]"
 time="2.5"><failure message="dw rel err 0.71">assert</failure><system-out>KDA_GPU_ERR dw 0.71</system-out>
</testcase>
<testcase classname="tests.ops.test_kda_gated_norm" file="tests/ops/test_kda_gated_norm.py"
 name="test_gpu_bf16[sigmoid]" time="1.5"><system-out>x</system-out></testcase>
<testcase classname="tests.memory.test_report" file="tests/memory/test_report.py" name="test_measure_memory_cuda"
 time="0.1"><error message="OutOfResources"/></testcase>
</testsuite></testsuites>"""

_XUNIT2 = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_gpu_parts" name="test_a_test_longer_than_the_budget_still_gets_a_part" time="4"/>
<testcase classname="tests.test_gpu_parts" name="test_commands_split_xdist_and_serial" time="1">
<skipped message="needs a CUDA GPU"/></testcase>
</testsuite></testsuites>"""


def test_table_from_junit_files(tmp_path):
    (tmp_path / "a.xml").write_text(_XUNIT1)
    (tmp_path / "b.xml").write_text(_XUNIT2)
    results = gp.read_junit(tmp_path / "a.xml") + gp.read_junit(tmp_path / "b.xml")
    assert {r.nodeid for r in results} >= {"tests/ops/test_kda_gated_norm.py::test_gpu_bf16[silu]",
                                           "tests/test_gpu_parts.py::test_commands_split_xdist_and_serial"}
    expected = [r.nodeid for r in results] + ["tests/ops/test_kda_gated_norm.py::test_never_ran"]
    table, green = gp.summary_table(results, expected)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in table.splitlines()[2:]}
    assert rows["tests/ops/test_kda_gated_norm.py"] == ["1", "1", "0", "0", "1", "4 |"]
    assert rows["tests/memory/test_report.py"][:4] == ["0", "0", "0", "1"]
    assert rows["tests/test_gpu_parts.py"][:3] == ["1", "0", "1"]
    assert not green
    assert gp.gpu_err_lines(results) == ["dw 0.71"]
    ok, green = gp.summary_table([r for r in results if r.outcome in ("passed", "skipped")])
    assert green and "**total**" in ok


def test_results_from_a_log_cut_short():
    log = "\n".join([
        "tests/ops/test_x.py::test_a PASSED                                   [ 10%]",
        "tests/ops/test_x.py::test_b[p1] FAILED                               [ 20%]",
        "[gw1] [ 30%] PASSED tests/ops/test_y.py::test_c[bf16-64]",
        "[gw0] [ 40%] SKIPPED tests/ops/test_y.py::test_d ",
        "[gw2] [ 50%] ERROR tests/ops/test_y.py::test_e",
        "tests/ops/test_x.py::test_z "])  # started, never finished (the deadline killed pytest)
    got = {r.nodeid: r.outcome for r in gp.read_log(log)}
    assert got == {"tests/ops/test_x.py::test_a": "passed", "tests/ops/test_x.py::test_b[p1]": "failed",
                   "tests/ops/test_y.py::test_c[bf16-64]": "passed", "tests/ops/test_y.py::test_d": "skipped",
                   "tests/ops/test_y.py::test_e": "errors"}
    _, green = gp.summary_table(gp.read_log(log), [*got, "tests/ops/test_x.py::test_z"])
    assert not green


def test_durations_update_and_committed_file(tmp_path):
    (tmp_path / "a.xml").write_text(_XUNIT1)
    cfg_path = tmp_path / "d.json"
    cfg_path.write_text(json.dumps({"default_s": 7, "durations": {"tests/old.py::t": 3.0}}))
    data = gp.update_durations(cfg_path, [tmp_path / "a.xml"])
    assert data["default_s"] == 7 and data["durations"]["tests/old.py::t"] == 3.0
    assert data["durations"]["tests/ops/test_kda_gated_norm.py::test_gpu_bf16[silu]"] == 2.5
    assert gp.Config.load(cfg_path).seconds("tests/old.py::t") == 3.0
    cfg = gp.Config(default_s=5.0, tests={"a.py::t": 2.0}, estimates={"a.py::t": 50.0, "a.py::u": 40.0})
    assert (cfg.seconds("a.py::t"), cfg.seconds("a.py::u"), cfg.seconds("a.py::v")) == (2.0, 40.0, 5.0)
    committed = gp.Config.load(gp.DURATIONS)
    assert committed.budget_s + 60 <= 600 and committed.warmup_s >= 60  # one 10-minute device call per part
    assert all((gp.REPO / s).is_file() for s in committed.serial)
    assert len(committed.tests) > 100  # measured on the H200
