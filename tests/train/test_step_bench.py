"""benchmarks/step.py on the CPU (--smoke): the rows it prints for the tiny model, the forced-uniform routing it
labels, and its flags."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "step.py"
    spec = importlib.util.spec_from_file_location("step_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_smoke_rows(bench, capsys):
    from moestack.ops.moe import routing

    real = routing.route
    rows = bench.main(["--smoke", "--accum", "2", "--steps", "1", "--routing", "uniform,learned"])
    out = capsys.readouterr().out
    assert routing.route is real  # the forced routing is undone
    assert [r.routing for r in rows] == ["uniform*", "learned"] and not any(r.error for r in rows)
    for r in rows:
        assert r.model == "tiny" and r.mode == "eager" and r.ran == "eager" and r.accum == 2
        assert r.tokens_per_s > 0 and r.step_ms > 0 and r.first_s > 0 and r.mfu >= 0
        assert r.busy != r.busy  # no GPU: not measured
    assert rows[0].load_max_mean == 1.0  # 32 tokens x 4 slots over 16 experts: 8 rows each
    assert rows[1].load_max_mean > 1.0
    assert out.count("| tiny |") == 2 and "uniform* = forced balanced routing" in out and bench.HEADER in out


def test_flags(bench):
    with pytest.raises(SystemExit):
        bench.parse(["--modes", "eager,fast"])
    args = bench.parse(["--smoke"])
    assert (args.models, args.modes, args.precisions, args.device) == ("tiny", "eager", "bf16", "cpu")
    assert bench.fmt(bench.Row("proxy", "learned", "eager", "bf16", 1, True, error="RuntimeError: x")).endswith(
        "error: RuntimeError: x |")
    assert torch.isfinite(torch.tensor(bench.PEAK_BF16))


def test_kernel_fields(bench):
    """--kernel FIELD=VALUE: a typed KernelSpec choice for every configuration, passed on to isolated children; a bad
    field or value is the parser's one-line error."""
    args = bench.parse(["--smoke", "--kernel", "moe.solve_graph=false", "--kernel", "fp8.cublas_min_rows=0"])
    assert args.kernel_spec.moe.solve_graph is False and args.kernel_spec.fp8.cublas_min_rows == 0
    argv = bench._child_argv(("tiny", "uniform", "eager", "bf16", 1, True), args, "row.json")
    assert argv[argv.index("--kernel") + 1] == "moe.solve_graph=false" and argv.count("--kernel") == 2
    for bad in ("moe.nope=1", "moe.solve_graph", "fp8.cublas_min_rows=-1"):
        with pytest.raises(SystemExit):
            bench.parse(["--smoke", "--kernel", bad])


@pytest.mark.slow
def test_isolated_rows(bench, monkeypatch):
    """--isolate: each configuration in a child process, its row read back; a child that dies before writing its
    row gives an error row with the exit code (not a lost row, not a traceback)."""
    rows = bench.main(["--smoke", "--steps", "1", "--accum", "1", "--isolate"])
    assert len(rows) == 1 and not rows[0].error and rows[0].tokens_per_s > 0 and rows[0].model == "tiny"
    monkeypatch.setattr(bench, "_child_argv", lambda *a: [sys.executable, "-c", "import sys; sys.exit(3)"])
    args = bench.parse(["--smoke"])
    row = bench.run_isolated(("tiny", "uniform", "eager", "bf16", 1, True), args)
    assert row.routing == "uniform*" and "exited with code 3" in row.error
    assert bench.fmt(row).endswith("before its row |")
