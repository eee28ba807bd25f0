"""Layers point one way: a module imports only from its own package or from a lower layer; inside the
controller, no module imports itself back through others.

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
    {"outlast.data"},  # Ray Data's reads: a rank's batches go to the device its training context names
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


# ---- no circle of imports inside the controller -----------------------------------------------------


def module_arrows(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package (a package right under outlast) it imports, every import
    counted as above."""
    names = {module_name(path, package.parent): path for path in sorted(package.rglob("*.py"))}
    arrows: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from outlast.controller import lifecycle` names a module; `from ...x import f` does not.
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                           for a in node.names]
            else:
                continue
            arrows[name] |= {t for t in targets if t in names and t != name}
    return arrows


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The sets of modules that import each other round a circle (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(arrows[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            ring = []
            while True:
                w = stack.pop()
                ring.append(w)
                if w == v:
                    break
            if len(ring) > 1:
                found.append(sorted(ring))

    for v in sorted(arrows):
        if v not in index:
            visit(v)
    return found


def test_the_check_names_a_circle_through_a_type_only_import(tmp_path):
    pkg = tmp_path / "outlast" / "controller"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from outlast.controller import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from outlast.controller.c import C\n")
    (pkg / "c.py").write_text("def f():\n    from outlast.controller.a import x\n")
    (pkg / "d.py").write_text("from outlast.controller.a import x\n")
    assert circles(module_arrows(pkg)) == [["outlast.controller.a", "outlast.controller.b", "outlast.controller.c"]]


def test_no_module_of_the_controller_imports_itself_back_through_others():
    found = circles(module_arrows(ROOT / "controller"))
    assert found == [], "modules that import each other round a circle: " + "; ".join(", ".join(r) for r in found)


# The commit machine (controller/commits/) never reaches back into the core: not by an import of its own, nor
# through a module it imports.
CORE_SIDE = {f"outlast.controller.{name}" for name in
             ("core", "core_state", "lifecycle", "ending", "on_workers", "handlers", "hang_steps", "preempt_steps",
              "commit_steps", "memory_restore", "heartbeat")}


def test_the_commit_machine_reaches_no_module_of_the_core_side():
    arrows = module_arrows(ROOT / "controller")
    machine = {name for name in arrows if name.startswith("outlast.controller.commits")}
    assert machine, "controller/commits/ is gone: move this test with it"
    reached, todo = set(), list(machine)
    while todo:
        for there in arrows[todo.pop()] - reached:
            reached.add(there)
            todo.append(there)
    assert sorted(reached & CORE_SIDE) == []


def test_no_import_sits_inside_a_function_of_the_controller():
    # An import inside a function hides an arrow between modules, most often one that closes a circle.
    inside = []
    for path in sorted((ROOT / "controller").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside += [f"{path}:{n.lineno}" for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert inside == []
