"""`moestack plan` is a pure cost query: the config and planner layers and the CLI's plan path must not import torch
(seconds of start-up; DESIGN.md layering). Checked in a fresh interpreter, the way the command runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _loaded_after(code: str) -> set[str]:
    probe = code + ("\nimport sys\nprint('TORCH:' + ' '.join(sorted(m for m in sys.modules"
                    " if m.split('.')[0] == 'torch')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    return set(out.stdout.strip().splitlines()[-1].removeprefix("TORCH:").split())


def test_planner_layers_do_not_import_torch():
    """Every module of planner/ (the pure cost model, cost/ included), the config modules it reads, and the plan
    command's module."""
    planner = sorted("moestack." + ".".join(p.relative_to(ROOT / "moestack").with_suffix("").parts).removesuffix(
        ".__init__") for p in (ROOT / "moestack" / "planner").rglob("*.py"))
    mods = ("moestack.config.model_spec", "moestack.config.plan", "moestack.config.cluster", "moestack.config.hf",
            *planner, "moestack.cli.plan")
    assert "moestack.planner.cost.step" in planner and "moestack.planner.search" in planner
    assert _loaded_after("\n".join(f"import {m}" for m in mods)) == set()


def test_plan_command_does_not_import_torch(tmp_path):
    code = (f"from moestack.cli.app import main\nrc = main(['plan', 'tiny', '--cluster', 'h200-1gpu', '--out', "
            f"{str(tmp_path / 'plan.yaml')!r}, '--json'])\nassert rc == 0, rc")
    assert _loaded_after(code) == set()
    assert (tmp_path / "plan.yaml").is_file()
