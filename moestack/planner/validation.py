"""The cost model against published training runs (tests/data/planner/published_runs.yaml).

Each run is evaluated as `moestack plan MODEL --cluster C --devices N --seq-len S --host-profile P --fix F` would
evaluate it: the published configuration is fixed, whatever the publication leaves open is the planner's choice (the
fastest plan, over the memory limit too when nothing fits). The result is compared with the published throughput and
the predicted memory with the device's HBM (a run that ran must not be predicted over it).
Used by tests/planner/test_validation.py (the accuracy bounds) and benchmarks/planner_validation.py (the table).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from moestack.config.base import ConfigError, StrictModel, read_yaml, validate
from moestack.config.cluster import GIB, ClusterSpec, load_cluster_spec
from moestack.config.model_spec import ModelSpec
from moestack.config.plan import HostProfileName
from moestack.planner.calibration import Calibration, load_calibration
from moestack.planner.cost.step import PlanCost
from moestack.planner.profile import load_any_model_spec
from moestack.planner.search import Planner, Problem, parse_fix

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED_RUNS = ROOT / "tests" / "data" / "planner" / "published_runs.yaml"
Metric = Literal["tokens_per_s_per_device", "tflops_per_device", "step_s"]


class ClusterOverrides(StrictModel):
    tier0_domain: int | None = Field(default=None, gt=0)  # devices in the job's scale-up domain (a Slurm segment)


class PublishedRun(StrictModel):
    """One published run (the data file's header says what each field means)."""

    name: str
    model: str
    model_overrides: dict[str, Any] = {}
    cluster: str
    cluster_overrides: ClusterOverrides = ClusterOverrides()
    devices: int = Field(gt=0)
    seq_len: int = Field(gt=1)
    host_profile: HostProfileName
    fix: str
    metric: Metric
    published: float = Field(gt=0)
    source: str
    notes: str = ""
    status: Literal["ok", "unmatched"] = "ok"
    reason: str = ""  # status unmatched: why the model cannot match it


@dataclass
class RunResult:
    run: PublishedRun
    cost: PlanCost
    predicted: float

    @property
    def error(self) -> float:
        """Predicted throughput over published, minus 1 (for step_s: published time over predicted time)."""
        if self.run.metric == "step_s":
            return self.run.published / self.predicted - 1
        return self.predicted / self.run.published - 1

    @property
    def memory_fraction(self) -> float:
        return self.cost.memory_total / self.cost.hbm_bytes


def load_runs(path: str | Path = PUBLISHED_RUNS) -> list[PublishedRun]:
    runs = read_yaml(path).get("runs")
    if not isinstance(runs, list):
        raise ConfigError(f"{path}: expected `runs:` with a list of runs")
    return [validate(PublishedRun, item, f"{path} run {i + 1}") for i, item in enumerate(runs)]


def _cluster(run: PublishedRun) -> ClusterSpec:
    cl = load_cluster_spec(run.cluster)
    domain = run.cluster_overrides.tier0_domain
    if domain is not None:
        tiers = [cl.tiers[0].model_copy(update={"domain_size": domain}), *cl.tiers[1:]]
        cl = validate(ClusterSpec, {**cl.model_dump(), "tiers": [t.model_dump() for t in tiers]}, run.name)
    return cl.with_devices(run.devices)


def run_problem(run: PublishedRun, cal: Calibration | None = None) -> tuple[Problem, dict]:
    """The Problem and the parsed --fix of one run."""
    spec = load_any_model_spec(ROOT / run.model)
    if run.model_overrides:
        spec = validate(ModelSpec, {**spec.model_dump(), **run.model_overrides}, f"{run.name} model_overrides")
    fix = parse_fix(run.fix)
    if "gbs" not in fix:
        raise ConfigError(f"{run.name}: fix must give gbs (the published global batch)")
    problem = Problem(run.model, run.cluster, spec, _cluster(run), cal or load_calibration(), run.seq_len,
                      fix["gbs"] * run.seq_len, fix.get("precision", "bf16"), fix.get("optimizer", "adamw"),
                      host_profile=run.host_profile)
    return problem, fix


def evaluate_run(run: PublishedRun, cal: Calibration | None = None) -> RunResult:
    problem, fix = run_problem(run, cal)
    result = Planner(problem).search(fix, require_fit=False)
    cost = result.best
    if cost is None:
        raise ConfigError(f"{run.name}: no plan matches its fix ({run.fix})")
    value = {"tokens_per_s_per_device": cost.tokens_per_s / run.devices, "tflops_per_device": cost.tflops_per_device,
             "step_s": cost.step_time_s}[run.metric]
    return RunResult(run, cost, value)


def evaluate_all(path: str | Path = PUBLISHED_RUNS, cal: Calibration | None = None) -> list[RunResult]:
    return [evaluate_run(run, cal) for run in load_runs(path)]


@dataclass
class Summary:
    matched: int
    median_abs_error: float
    worst_error: float  # signed, largest |error|
    over_hbm: list[str]  # runs predicted over 100% of HBM


def summarize(results: list[RunResult]) -> Summary:
    ok = [r for r in results if r.run.status == "ok"]
    errors = [r.error for r in ok]
    worst = max(errors, key=abs) if errors else 0.0
    return Summary(len(ok), statistics.median(abs(e) for e in errors) if errors else 0.0, worst,
                   [r.run.name for r in results if r.memory_fraction > 1.0])


UNITS = {"tokens_per_s_per_device": "tok/s/GPU", "tflops_per_device": "TFLOP/s/GPU", "step_s": "s/step"}


def table(results: list[RunResult]) -> list[str]:
    """A markdown table: run, published, predicted, error, memory, the plan the search chose, the binding term."""
    lines = ["| run | GPUs | published | predicted | error | memory (of HBM) | chosen | binding |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        c, p = r.cost, r.cost.plan
        chosen = f"{p.short()} mbs{p.micro_batch_size} {p.schedule} rc {p.recompute.short()}"
        status = "" if r.run.status == "ok" else " (unmatched)"
        lines.append(f"| {r.run.name}{status} | {r.run.devices} | {r.run.published:g} {UNITS[r.run.metric]} | "
                     f"{r.predicted:.4g} | {r.error:+.1%} | {c.memory_total / GIB:.0f} of {c.hbm_bytes / GIB:.0f} GiB "
                     f"({r.memory_fraction:.0%}) | {chosen} | {c.binding} |")
    s = summarize(results)
    lines.append("")
    lines.append(f"{s.matched} matched runs: median |error| {s.median_abs_error:.1%}, worst {s.worst_error:+.1%}; "
                 f"predicted over HBM: {', '.join(s.over_hbm) or 'none'}")
    return lines
