"""One meaning per name, checked over the package's source.

- A class name is defined once in outlast: a reader who meets `Decision` in one module must not
  find another `Decision` meaning something else in the next. The one exception is the names
  Ray Train's API gives a class of each framework it integrates (`ray.train.lightning.
  RayTrainReportCallback`, `ray.train.xgboost.RayTrainReportCallback`, ...): a user imports them
  by those names from each framework's module.
- 'drain' in a name means a node going away. Emptying a socket, a pipe or a file descriptor is
  called something else (take, receive, consume, clear), so the packages that never see a node
  go away (isolation, executor) name nothing so, and each function or class elsewhere whose name
  says 'drain' is one listed here as acting on a node's drain.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "outlast"

# Ray Train's names, one class per framework module (outlast/train/<framework>.py).
RAY_PER_FRAMEWORK = {"RayTrainReportCallback", "PreemptionCheckpointCallback"}

# Packages that never see a node go away.
NO_DRAIN_HERE = ("isolation", "executor")

# Every function, method and class whose name says 'drain', by module: each acts on a node's drain.
NODE_DRAINS = {
    "agent/agent.py": {"draining", "drain", "_apply_drain"},
    "agent/drain_sources.py": {"DrainAsked", "DrainSources"},
    "agent/etcd_role.py": {"drain", "drained_here"},
    "agent/node_core.py": {"drain"},
    "agent/roles.py": {"drain", "drained_here"},
    "agent/tier_schedule.py": {"drain"},
    "agent/tier_server.py": {"drain"},
    "cli/drain.py": {"cmd_drain"},
    "cli/main.py": {"_draining"},
    "cluster/nodetable.py": {"NodesToDrain", "drain"},
    "cluster/store_view.py": {"PutDrain", "drain_value", "drain_of"},
    "controller/handlers.py": {"on_node_draining"},
    "controller/commits/view.py": {"draining"},
    "controller/heartbeat.py": {"saved_for_drain_at"},
    "controller/lifecycle.py": {"preempted_by_drain"},
    "controller/live.py": {"on_drain"},
    "controller/live_steps.py": {"on_drain"},
    "controller/nodes.py": {"note_draining", "drain_of", "_overlay_drains"},
    "controller/policy.py": {"caused_by_drain"},
    "controller/runstate.py": {"note_drain"},
    "protocol/messages.py": {"NodeDraining", "DrainNode", "DrainAck", "DrainRefused"},
    "sim/agent_node.py": {"drain"},
    "sim/cluster.py": {"drain"},
    "sim/fleet.py": {"_drain"},
    "sim/fleet_cost.py": {"drain"},
    "sim/run.py": {"drain_node", "_drain"},
    "slurm/launcher.py": {"Draining", "_drain"},
    "slurm/policy.py": {"DrainOrder", "AfterDrain", "after_drain"},
    "slurm/scontrol.py": {"draining"},
    "storage/records.py": {"DrainRecord"},
    "testing.py": {"drain_node"},
}


def _modules(root: Path):
    for path in sorted(root.rglob("*.py")):
        yield path.relative_to(root).as_posix(), ast.parse(path.read_text(), filename=str(path))


def _names(tree: ast.AST):
    """(line, name) for every name the module binds or reads: definitions, arguments, attributes, keywords."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.value.lineno, node.arg
        elif isinstance(node, ast.alias):
            yield node.lineno, node.asname or node.name


def duplicate_classes(root: Path) -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for module, tree in _modules(root):
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{module}:{node.lineno}")
    return {name: places for name, places in where.items() if len(places) > 1 and name not in RAY_PER_FRAMEWORK}


def drains_of_something_else(root: Path, listed: dict[str, set[str]]) -> list[str]:
    """Names that say 'drain' and are not listed, and listed names no longer defined (a list kept true)."""
    problems, seen = [], set()
    for module, tree in _modules(root):
        seen.add(module)
        if module.split("/")[0] in NO_DRAIN_HERE:
            problems += [f"{module}:{line}: {name}" for line, name in _names(tree) if "drain" in name.lower()]
            continue
        defined = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and "drain" in node.name.lower():
                defined.add(node.name)
                if node.name not in listed.get(module, set()):
                    problems.append(f"{module}:{node.lineno}: {node.name}")
        gone = sorted(listed.get(module, set()) - defined)
        problems += [f"{module}: {name} is listed but not defined" for name in gone]
    return problems + [f"{module}: listed, but there is no such module" for module in sorted(set(listed) - seen)]


def test_each_class_name_is_defined_once():
    duplicates = duplicate_classes(ROOT)
    assert not duplicates, ("class names defined in more than one module (name each for what it is in its own "
                            f"module): {duplicates}")


def test_drain_names_only_a_node_going_away():
    problems = drains_of_something_else(ROOT, NODE_DRAINS)
    assert not problems, ("names that say 'drain' where no node goes away: call emptying a socket, pipe or fd "
                          "something else (take, receive, consume, clear); a new function acting on a node's drain "
                          f"goes into NODE_DRAINS: {problems}")


def test_the_checks_see_what_they_look_for(tmp_path):
    (tmp_path / "isolation").mkdir()
    (tmp_path / "isolation" / "monitor.py").write_text("class Decision:\n    def drain(self): pass\n")
    (tmp_path / "controller").mkdir()
    (tmp_path / "controller" / "policy.py").write_text("class Decision:\n    pass\n")
    (tmp_path / "controller" / "wakeup.py").write_text("def drain(fd):\n    pass\n")
    assert duplicate_classes(tmp_path) == {"Decision": ["controller/policy.py:1", "isolation/monitor.py:1"]}
    listed = {"controller/nodes.py": {"drain_of"}}
    (tmp_path / "controller" / "nodes.py").write_text("def lose(node):\n    pass\n")
    assert drains_of_something_else(tmp_path, listed) == [
        "controller/nodes.py: drain_of is listed but not defined", "controller/wakeup.py:1: drain",
        "isolation/monitor.py:2: drain"]
