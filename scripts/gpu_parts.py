"""The GPU test suite in parts that each fit one 10-minute device call (scripts/gpu_check.sh drives it).

    python3 scripts/gpu_parts.py list                    # the parts: estimated seconds, files / tests in each
    python3 scripts/gpu_parts.py run --part 2 -n 4       # run part 2 (4 pytest-xdist workers), then the table
    python3 scripts/gpu_parts.py run --part all          # every part, one after the other
    python3 scripts/gpu_parts.py summary OUT/*.xml       # the table of junit files written by `run`
    python3 scripts/gpu_parts.py durations OUT/*.xml     # fold measured durations into scripts/gpu_durations.json

Partition: the GPU-marked tests (`pytest --collect-only -m gpu`) grouped by file, each file's estimate the sum of
its tests' seconds in scripts/gpu_durations.json ("durations": nodeid -> s; "default_s" for a test it does not
list).
A file larger than one part's share is cut into runs of its tests. Units go, largest first, to the part whose
estimate grows least (greedy LPT); the number of parts grows until every part's estimate fits the budget. A part's
estimate: warmup_s (collection and first Triton compiles) + its xdist-run tests' seconds / (jobs * efficiency) +
its serial tests' seconds. Files under "serial" (they measure CUDA memory or time, or hold the GPU alone) run in a
second pytest without xdist. The plan depends only on the collected tests, the durations file, --budget and -n,
so `list` and `run` with the same flags agree. Per-test timeout: pytest-timeout (--timeout, default 300 s).

The table: per test file passed / failed / skipped / errors / not run, and seconds, read from the junit files
(the pytest log when a run was cut short), then the `*_GPU_ERR` lines the GPU tests print. Exit status 1 if a
test failed or errored or did not run. Works without a GPU: the tests then collect and skip (a dry run of the
partition and the table), and --dry-run prints the pytest commands without running them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DURATIONS = REPO / "scripts" / "gpu_durations.json"
# n workers on one GPU: the whole suite took 194 s under -n 6 for 1008 test-seconds (0.87 efficiency, measured with
# the durations file); 0.5 leaves room for parts with fewer, longer tests
XDIST_EFFICIENCY = 0.5
OUTCOMES = ("passed", "failed", "skipped", "errors")


@dataclass
class Config:
    default_s: float = 8.0
    warmup_s: float = 60.0
    budget_s: float = 540.0
    serial: list[str] = field(default_factory=list)
    tests: dict[str, float] = field(default_factory=dict)  # measured seconds
    estimates: dict[str, float] = field(default_factory=dict)  # tests not yet measured on the GPU: upper guesses

    @classmethod
    def load(cls, path: Path) -> Config:
        data = json.loads(path.read_text()) if path.is_file() else {}
        known = {k: data[k] for k in ("default_s", "warmup_s", "budget_s", "serial", "estimates") if k in data}
        return cls(**known, tests=data.get("durations", {}))

    def seconds(self, nodeid: str) -> float:
        return float(self.tests.get(nodeid, self.estimates.get(nodeid, self.default_s)))

    def is_serial(self, file: str) -> bool:
        return any(file == s or file.startswith(s.rstrip("/") + "/") for s in self.serial)


@dataclass
class Unit:
    """Tests run together: a whole file, or a run of one large file's tests."""

    file: str
    nodeids: list[str]
    seconds: float
    serial: bool


@dataclass
class Part:
    units: list[Unit] = field(default_factory=list)

    def sums(self) -> tuple[float, float]:
        par = sum(u.seconds for u in self.units if not u.serial)
        return par, sum(u.seconds for u in self.units if u.serial)

    def estimate(self, cfg: Config, jobs: int) -> float:
        par, ser = self.sums()
        return _estimate(par, ser, cfg, jobs)

    def nodeids(self, serial: bool) -> list[str]:
        return [n for u in self.units if u.serial == serial for n in u.nodeids]


def _estimate(par: float, ser: float, cfg: Config, jobs: int) -> float:
    speed = jobs * XDIST_EFFICIENCY if jobs > 1 else 1.0
    return cfg.warmup_s + par / max(speed, 1.0) + ser


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def make_units(nodeids: list[str], cfg: Config, cap_xdist: float, cap_serial: float) -> list[Unit]:
    """Group by file; a file over its cap (test-seconds) is cut, in collection order, into runs of at most it."""
    by_file: dict[str, list[str]] = {}
    for n in nodeids:
        by_file.setdefault(file_of(n), []).append(n)
    units = []
    for file, ids in by_file.items():
        serial = cfg.is_serial(file)
        cap = cap_serial if serial else cap_xdist
        chunk, total = [], 0.0
        for n in ids:
            s = cfg.seconds(n)
            if chunk and total + s > cap:
                units.append(Unit(file, chunk, total, serial))
                chunk, total = [], 0.0
            chunk.append(n)
            total += s
        if chunk:
            units.append(Unit(file, chunk, total, serial))
    return units


def partition(nodeids: list[str], cfg: Config, jobs: int = 1, budget: float | None = None) -> list[Part]:
    """The parts (see the module docstring); every part's estimate <= budget unless one unit alone exceeds it."""
    budget = cfg.budget_s if budget is None else budget
    room = budget - cfg.warmup_s
    assert room > 0, f"budget {budget} s leaves nothing after the {cfg.warmup_s} s warmup"
    # a unit must fit one part: an xdist unit's test-seconds count 1 / (jobs * efficiency)
    units = make_units(nodeids, cfg, cap_xdist=room * max(jobs * XDIST_EFFICIENCY, 1.0), cap_serial=room)
    if not units:
        return []
    order = sorted(units, key=lambda u: (-u.seconds, u.file, u.nodeids[0]))
    par_total = sum(u.seconds for u in units if not u.serial)
    ser_total = sum(u.seconds for u in units if u.serial)
    k = max(1, math.ceil((_estimate(par_total, ser_total, cfg, jobs) - cfg.warmup_s) / room))
    while True:
        parts = [Part() for _ in range(k)]
        for u in order:
            def grown(p: Part) -> float:
                par, ser = p.sums()
                return _estimate(par + (0 if u.serial else u.seconds), ser + (u.seconds if u.serial else 0), cfg,
                                 jobs)
            min(parts, key=grown).units.append(u)
        if all(p.estimate(cfg, jobs) <= budget for p in parts) or k >= len(units):
            break
        k += 1
    for p in parts:  # run order inside a part: collection order (files next to each other)
        p.units.sort(key=lambda u: nodeids.index(u.nodeids[0]))
    return [p for p in parts if p.units]


def collect(marker: str, paths: list[str], python: str) -> list[str]:
    # (-o addopts: the repo's -q would make it -qq, which prints counts, not node ids)
    cmd = [python, "-m", "pytest", "-o", "addopts=--import-mode=importlib", "--collect-only", "-q", "-p",
           "no:cacheprovider", "-m", marker, *paths]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    ids = [line.strip() for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if proc.returncode not in (0, 5) or (not ids and proc.returncode != 5):
        sys.exit(f"gpu_parts: collecting the tests failed ({' '.join(cmd)}):\n"
                 f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return ids


def format_plan(parts: list[Part], cfg: Config, jobs: int, budget: float) -> str:
    lines = [f"{len(parts)} parts, budget {budget:.0f} s each (warmup {cfg.warmup_s:.0f} s, -n {jobs}, "
             f"{len(cfg.tests)} measured test durations, {len(cfg.estimates)} estimated, {cfg.default_s:.0f} s for any "
             f"other)",
             "| part | est. s | tests | files |", "|---|---|---|---|"]
    for i, p in enumerate(parts, 1):
        files = []
        for u in p.units:
            tag = f"{u.file} ({len(u.nodeids)}{', serial' if u.serial else ''})"
            files.append(tag)
        n = sum(len(u.nodeids) for u in p.units)
        lines.append(f"| {i} | {p.estimate(cfg, jobs):.0f} | {n} | {'; '.join(files)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# results


@dataclass
class Result:
    nodeid: str
    outcome: str  # one of OUTCOMES
    seconds: float = 0.0
    output: str = ""


def _nodeid_from_junit(case: ET.Element) -> str:
    """pytest's nodeid of a junit testcase: xunit1 has a file attribute; otherwise the dotted classname is mapped
    back onto a path that exists (tests.ops.test_x[.TestClass])."""
    name, classname = case.get("name", ""), case.get("classname", "")
    parts = classname.split(".")
    file = case.get("file")
    if file:
        n_file = len(Path(file).with_suffix("").parts)
        return "::".join([file, *parts[n_file:], name])
    for i in range(len(parts), 0, -1):
        candidate = "/".join(parts[:i]) + ".py"
        if (REPO / candidate).is_file() or i == 1:
            return "::".join([candidate, *parts[i:], name])
    return name


def read_junit(path: Path) -> list[Result]:
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        if "error" in tags:
            outcome = "errors"
        elif "failure" in tags:
            outcome = "failed"
        elif "skipped" in tags:
            outcome = "skipped"
        else:
            outcome = "passed"
        out = "".join((child.text or "") for child in case if child.tag in ("system-out", "system-err"))
        results.append(Result(_nodeid_from_junit(case), outcome, float(case.get("time") or 0.0), out))
    return results


_LOG_LINE = re.compile(r"(?:^|\s)(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\s+(\S+::\S+)|(\S+::\S+)\s+"
                       r"(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
_LOG_OUTCOME = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "SKIPPED": "skipped",
                "XFAIL": "skipped", "ERROR": "errors"}


def read_log(text: str) -> list[Result]:
    """Results from a `pytest -v` log (serial: 'nodeid PASSED', xdist: '[gw0] ... PASSED nodeid')."""
    seen: dict[str, Result] = {}
    for line in text.splitlines():
        m = _LOG_LINE.search(line)
        if m:
            word, nodeid = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            if nodeid not in seen or _LOG_OUTCOME[word] in ("failed", "errors"):
                seen[nodeid] = Result(nodeid, _LOG_OUTCOME[word])
    return list(seen.values())


def summary_table(results: list[Result], expected: list[str] | None = None) -> tuple[str, bool]:
    """(markdown table per file, green). `expected`: the nodeids that should have run (missing = not run)."""
    rows: dict[str, dict[str, float]] = {}
    got = set()
    for r in results:
        row = rows.setdefault(file_of(r.nodeid), dict.fromkeys((*OUTCOMES, "not run", "seconds"), 0))
        row[r.outcome] += 1
        row["seconds"] += r.seconds
        got.add(r.nodeid)
    for n in expected or []:
        if n not in got:
            rows.setdefault(file_of(n), dict.fromkeys((*OUTCOMES, "not run", "seconds"), 0))["not run"] += 1
    lines = ["| file | passed | failed | skipped | errors | not run | s |", "|---|---|---|---|---|---|---|"]
    total = dict.fromkeys((*OUTCOMES, "not run", "seconds"), 0)
    for file in sorted(rows):
        row = rows[file]
        for k in total:
            total[k] += row[k]
        lines.append(f"| {file} | " + " | ".join(str(int(row[k])) for k in (*OUTCOMES, "not run")) +
                     f" | {row['seconds']:.0f} |")
    lines.append("| **total** | " + " | ".join(f"**{int(total[k])}**" for k in (*OUTCOMES, "not run")) +
                 f" | **{total['seconds']:.0f}** |")
    green = total["failed"] == 0 and total["errors"] == 0 and total["not run"] == 0
    return "\n".join(lines), green


def gpu_err_lines(results: list[Result]) -> list[str]:
    return [line.split("_GPU_ERR", 1)[1].strip(" :") if "_GPU_ERR" in line else line
            for r in results for line in r.output.splitlines() if "_GPU_ERR" in line]


def update_durations(cfg_path: Path, junits: list[Path]) -> dict:
    """The durations file with every test of `junits` set to its measured seconds (others kept)."""
    data = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    tests = dict(data.get("durations", {}))
    for path in junits:
        for r in read_junit(path):
            if r.outcome != "skipped":
                tests[r.nodeid] = round(r.seconds, 2)
    data["durations"] = dict(sorted(tests.items()))
    return data


# ---------------------------------------------------------------------------------------------------------------
# running


def _has(module: str, python: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def pytest_commands(part: Part, index: int, out: Path, python: str, jobs: int, timeout: float,
                    timeout_plugin: bool, xdist: bool) -> list[tuple[list[str], list[str], Path]]:
    """(command, nodeids, junit path) for the part's xdist run and its serial run."""
    base = [python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
            "-o", "junit_logging=system-out", "-o", "addopts=--import-mode=importlib --durations=15"]
    if timeout_plugin:
        base += ["--timeout", str(int(timeout))]
    cmds = []
    for serial in (False, True):
        ids = part.nodeids(serial)
        if not ids:
            continue
        junit = out / f"part{index}_{'serial' if serial else 'xdist'}.xml"
        cmd = [*base, f"--junitxml={junit}"]
        if not serial and xdist and jobs > 1:
            cmd += ["-n", str(jobs)]
        elif xdist:
            cmd += ["-p", "no:xdist"]
        cmds.append((cmd + ids, ids, junit))
    return cmds


def run_part(part: Part, index: int, out: Path, python: str, jobs: int, timeout: float, deadline: float,
             dry_run: bool) -> tuple[list[Result], list[str]]:
    timeout_plugin, xdist = _has("pytest_timeout", python), _has("xdist", python)
    if not timeout_plugin:
        print("gpu_parts: pytest-timeout is not installed: no per-test timeout (the part's deadline still holds)")
    if jobs > 1 and not xdist:
        print(f"gpu_parts: pytest-xdist is not installed: -n {jobs} ignored, tests run one at a time")
    results, expected = [], []
    for cmd, ids, junit in pytest_commands(part, index, out, python, jobs, timeout, timeout_plugin, xdist):
        expected += ids
        shown = " ".join(cmd[: cmd.index(ids[0])]) + f" <{len(ids)} tests>"
        print(f"== part {index}: {shown}", flush=True)
        if dry_run:
            continue
        log = junit.with_suffix(".log")
        left = max(deadline - time.monotonic(), 1.0)
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            watchdog = threading.Timer(left, lambda: os.killpg(proc.pid, signal.SIGKILL))
            watchdog.start()
            for line in proc.stdout:  # tee
                sys.stdout.write(line)
                fh.write(line)
            proc.wait()
            watchdog.cancel()
        if proc.returncode == -signal.SIGKILL:
            print(f"gpu_parts: part {index} stopped at its deadline ({left:.0f} s after this pytest started)")
        if junit.is_file():
            results += read_junit(junit)
        else:
            results += read_log(log.read_text())
    return results, expected


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("list", "run", "summary", "durations"))
    ap.add_argument("files", nargs="*", help="junit files (summary, durations)")
    ap.add_argument("--part", default="all", help="1..K or all (run)")
    ap.add_argument("-n", "--jobs", type=int, default=1,
                    help="pytest-xdist workers for the non-serial tests (default 1)")
    ap.add_argument("--budget", type=float, default=None, help="seconds per part (default: durations file)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-test timeout, seconds")
    ap.add_argument("--durations", type=Path, default=DURATIONS)
    ap.add_argument("--marker", default="gpu")
    ap.add_argument("--tests", nargs="*", default=["tests"])
    ap.add_argument("--out", type=Path, default=None, help="folder for junit files and logs (run)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--dry-run", action="store_true", help="print the pytest commands, run nothing (run)")
    args = ap.parse_args(argv)
    cfg = Config.load(args.durations)
    budget = cfg.budget_s if args.budget is None else args.budget

    if args.command == "summary":
        results = [r for f in args.files for r in read_junit(Path(f))]
        table, green = summary_table(results)
        print(table)
        return 0 if green else 1
    if args.command == "durations":
        data = update_durations(args.durations, [Path(f) for f in args.files])
        args.durations.write_text(json.dumps(data, indent=1) + "\n")
        print(f"{args.durations}: {len(data['durations'])} test durations (note where and how in _measured)")
        return 0

    start = time.monotonic()
    nodeids = collect(args.marker, args.tests, args.python)
    parts = partition(nodeids, cfg, args.jobs, budget)
    if args.command == "list":
        print(format_plan(parts, cfg, args.jobs, budget))
        return 0
    if args.part == "all":
        chosen = list(range(1, len(parts) + 1))
    else:
        if not args.part.isdigit() or not 1 <= int(args.part) <= len(parts):
            print(f"gpu_parts: --part must be 1..{len(parts)} or all, got {args.part!r}", file=sys.stderr)
            return 2
        chosen = [int(args.part)]
    out = args.out or Path(os.environ.get("OUT") or REPO / "runs" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    results, expected = [], []
    for k in chosen:
        # one part's deadline: its budget from the start of this command (collection counts), with room for the table
        deadline = (start if len(chosen) == 1 else time.monotonic()) + budget
        got, want = run_part(parts[k - 1], k, out, args.python, args.jobs, args.timeout, deadline, args.dry_run)
        results += got
        expected += want
    if args.dry_run:
        return 0
    table, green = summary_table(results, expected)
    print(f"\n== gpu_parts: part {args.part} of {len(parts)}, {time.monotonic() - start:.0f} s")
    print(table)
    for line in gpu_err_lines(results):
        print(f"  {line}")
    return 0 if green else 1


if __name__ == "__main__":
    sys.exit(main())
