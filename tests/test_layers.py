"""Imports point down the layers (DESIGN.md): every `moestack` import in every module under moestack/ -- module level,
inside functions, under TYPE_CHECKING, relative, `from moestack import X`, and the string forms
`importlib.import_module("moestack.X")` / `importlib.util.find_spec(...)` -- names a package at the importer's layer or
below. Parsed with `ast`, nothing is imported.

The order, lowest first:

    config -> planner (the pure cost model) -> ops -> model -> memory -> parallel -> train -> tune -> cli -> __main__

The issue writes "parallel / memory" as one level. Here memory sits just below parallel: parallelize() applies the
memory policies (moestack.memory.apply) as one step of its fixed order, and no memory module needs parallel/
(the memory policies work on a single-device model; the optimizers in memory/adamw.py shard nothing themselves).
So parallel may import memory and memory may not import parallel. moestack/__init__.py imports nothing of the
package (every import would load it).

A new subpackage or top-level module fails the test until it is given a place in LAYERS. The package checked is
the one PYTHONPATH resolves, so `PYTHONPATH=/other/checkout pytest tests/test_layers.py` checks another tree.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

# the moestack that PYTHONPATH resolves (found, not imported: a top-level find_spec runs no package code)
PACKAGE = Path(importlib.util.find_spec("moestack").origin).parent

LAYERS = ["config", "planner", "ops", "model", "memory", "parallel", "train", "tune", "cli", "__main__"]
RANK = {name: i for i, name in enumerate(LAYERS)}
STRING_IMPORTERS = {"import_module", "find_spec", "__import__", "_optional"}  # called with a module name


def _layer_of_file(path: Path, root: Path) -> str:
    """moestack/X/... -> X; moestack/X.py -> X."""
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _module_parts(path: Path, root: Path) -> list[str]:
    """The package a relative import in `path` is relative to, as dotted parts (moestack/a/b.py -> moestack.a)."""
    return ["moestack", *path.relative_to(root).parent.parts]


def _string_module(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)  # f"moestack.ops.dsa.{name}": the fixed prefix names the package
    return None


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every import of a moestack module in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _module_parts(path, root)
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "moestack":  # from moestack import planner, cli
                found += [(node.lineno, f"moestack.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in STRING_IMPORTERS:
                text = _string_module(node.args[0])
                if text is not None:
                    found.append((node.lineno, text))
    return sorted((line, m) for line, m in found if m.split(".")[0] == "moestack")


def upward_imports(root: Path = PACKAGE) -> list[str]:
    """One line per import that points up (or at a package with no layer): file:line: layer -> module."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        mine = _layer_of_file(path, root)
        if mine not in RANK and mine != "__init__":
            problems.append(f"{rel}: {mine} has no layer (add it to LAYERS in tests/test_layers.py)")
            continue
        for line, module in imported_modules(path, root):
            parts = module.split(".")
            if mine == "__init__":
                problems.append(f"{rel}:{line}: moestack/__init__.py imports {module} (it must import nothing of the "
                                "package)")
                continue
            if len(parts) < 2:
                problems.append(f"{rel}:{line}: [{mine}] imports the bare package {module}")
                continue
            target = parts[1].rstrip(".")
            if target not in RANK:
                problems.append(f"{rel}:{line}: [{mine}] imports {module}, and moestack.{target} has no layer")
            elif RANK[target] > RANK[mine]:
                problems.append(f"{rel}:{line}: [{mine}] imports {module} from the higher layer {target}")
    return problems


def test_imports_point_down_the_layers():
    problems = upward_imports()
    assert not problems, (f"{len(problems)} import(s) against the layer order {' -> '.join(LAYERS)}:\n"
                          + "\n".join(problems))


def test_every_package_has_a_layer():
    names = {p.name if p.is_dir() else p.stem for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").is_file()) or p.suffix == ".py"}
    assert names - {"__init__"} <= set(RANK), f"no layer for {sorted(names - {'__init__'} - set(RANK))}"


def test_the_check_sees_every_import_form(tmp_path):
    """The parser catches each form it claims to (a checker that misses a form cannot fail on it)."""
    pkg = tmp_path / "moestack"
    (pkg / "planner").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "planner" / "__init__.py").write_text("")
    (pkg / "planner" / "bad.py").write_text(
        "import moestack.model.block\n"
        "from moestack import train\n"
        "from ..tune import calibrate\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from moestack.ops import kda\n"
        "def f():\n"
        "    from moestack.cli.app import main\n"
        "    import importlib\n"
        "    importlib.import_module('moestack.memory.apply')\n"
        "    importlib.import_module(f'moestack.parallel.{f}')\n"
        "from moestack.config.base import ConfigError\n"
        "from . import profile\n"
    )
    got = upward_imports(pkg)
    targets = [line.split(" imports ")[1].split(" ")[0] for line in got]
    assert targets == ["moestack.model.block", "moestack.train", "moestack.tune", "moestack.ops",
                       "moestack.cli.app", "moestack.memory.apply", "moestack.parallel."], got
    assert all(line.startswith("moestack/planner/bad.py:") for line in got)
