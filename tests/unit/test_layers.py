"""Layers point one way: a module imports only from its own package or from a lower layer.

The order is the one docs/architecture.md describes. Every import counts, including those
inside functions and under TYPE_CHECKING: a lazy import is still an arrow between layers.
A new package gets a line here, at the layer it belongs to.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "outlast"

# Bottom first. Units in one layer may not import each other either: peers stay independent.
LAYERS: list[set[str]] = [
    {"outlast.procutil", "outlast.runenv", "outlast.identity", "outlast.statedir", "outlast.trace", "outlast.threads"},
    {"outlast.protocol", "outlast.faults", "outlast.metrics"},
    {"outlast.storage", "outlast.isolation", "outlast.cluster", "outlast.drain"},
    {"outlast.errors", "outlast.client"},
    {"outlast.agent", "outlast.controller", "outlast.executor", "outlast.slurm"},
    {"outlast.train"},
    {"outlast.compat"},
    {"outlast.cli", "outlast.testing", "outlast.sim", "outlast"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def unit_of(module: str) -> str:
    """The layer unit a module belongs to: its subpackage or top-level module under outlast."""
    parts = module.split(".")
    return ".".join(parts[:2])


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every absolute import of outlast in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "outlast":
            found += [(node.lineno, f"outlast.{alias.name}") for alias in node.names]  # `from outlast import train`
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.append((node.lineno, "<relative>"))
    return [(line, name) for line, name in found if name == "<relative>" or name.split(".")[0] == "outlast"]


def upward_arrows(root: Path) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        mod = module_name(path, root)
        here = mod if mod == "outlast" else unit_of(mod)
        if here not in RANK:
            problems.append(f"{path}: {here} is in no layer; add it to LAYERS in {__file__}")
            continue
        for line, name in imports_of(path):
            if name == "<relative>":
                problems.append(f"{path}:{line}: a relative import; write the absolute module name")
                continue
            there = unit_of(name)
            if there == here or there == "outlast":
                continue
            if there not in RANK:
                problems.append(f"{path}:{line}: imports {name}, which is in no layer")
            elif RANK[there] >= RANK[here]:
                problems.append(f"{path}:{line}: {here} (layer {RANK[here]}) imports {name} "
                                f"(layer {RANK[there]}); only lower layers may be imported")
    return problems


def test_no_module_imports_upward_or_sideways():
    assert upward_arrows(ROOT) == []


def test_the_check_sees_an_upward_import_inside_a_function(tmp_path):
    pkg = tmp_path / "outlast"
    (pkg / "controller").mkdir(parents=True)
    (pkg / "controller" / "x.py").write_text("def f():\n    from outlast.train.trainer import Trainer\n")
    (pkg / "train").mkdir()
    (pkg / "train" / "y.py").write_text("from outlast.controller.x import f\n")
    problems = upward_arrows(pkg)
    assert len(problems) == 1 and "controller/x.py:2" in problems[0] and "outlast.train.trainer" in problems[0]


@pytest.mark.parametrize("source, expected", [
    ("from outlast.agent.agent import Agent\n", "in the same layer"),
    ("import outlast.newthing\n", "in no layer"),
])
def test_the_check_refuses_peers_and_unknown_units(tmp_path, source, expected):
    pkg = tmp_path / "outlast"
    (pkg / "executor").mkdir(parents=True)
    (pkg / "executor" / "z.py").write_text(source)
    problems = upward_arrows(pkg)
    assert len(problems) == 1
    if expected == "in the same layer":
        layer = RANK["outlast.agent"]
        assert f"(layer {layer}) imports outlast.agent.agent (layer {layer})" in problems[0]
    else:
        assert "outlast.newthing" in problems[0]


def test_the_check_sees_a_package_imported_from_the_top_package(tmp_path):
    pkg = tmp_path / "outlast"
    (pkg / "controller").mkdir(parents=True)
    (pkg / "controller" / "x.py").write_text("from outlast import train\n")
    (pkg / "train").mkdir()
    problems = upward_arrows(pkg)
    assert len(problems) == 1 and "imports outlast.train" in problems[0]
