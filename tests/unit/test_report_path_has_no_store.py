"""report() never touches etcd: the worker's side cannot reach the store's client at all, the
controller's core is pure, and what the driver's loop asks of its store table on every turn
reads memory that the watch thread fills, never the network."""

from __future__ import annotations

import ast
import inspect
import textwrap
from importlib.util import find_spec
from pathlib import Path

from outlast.cluster.etcd_store import EtcdStore
from outlast.controller.store_table import StoreTable

STORE_MODULES = {"outlast.cluster.etcd_store", "outlast.cluster.store_session", "outlast.controller.store_table",
                 "etcd3gw", "requests"}


def imports_of(module: str) -> set[str]:
    spec = find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return set()
    out = set()
    for node in ast.walk(ast.parse(Path(spec.origin).read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if find_spec_safe(f"{node.module}.{a.name}")}
    return out


def find_spec_safe(name: str) -> bool:
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def closure(roots: list[str], skip: frozenset[str] = frozenset()) -> set[str]:
    """Every module reachable by imports (lazy ones too) from `roots`, within outlast, plus what they name outside;
    `skip`: modules not followed (a package's __init__ that only re-exports its API for users)."""
    seen, todo = set(), list(roots)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        if mod.split(".")[0] == "outlast" and mod not in skip:
            todo += sorted(imports_of(mod))
    return seen


def test_the_worker_side_of_report_cannot_reach_the_store():
    reach = closure(["outlast.train._session", "outlast.train.worker_main", "outlast.train.collective",
                     "outlast.train.preemption", "outlast.train.checkpoint"],
                    skip=frozenset({"outlast", "outlast.train"}))
    assert "outlast.train._session" in reach and "outlast.protocol.messages" in reach  # the walk does walk
    assert not reach & STORE_MODULES, sorted(reach & STORE_MODULES)


def test_the_controller_core_that_answers_reports_cannot_reach_the_store():
    reach = closure(["outlast.controller.core"])
    assert "outlast.controller.handlers" in reach
    assert not reach & STORE_MODULES, sorted(reach & STORE_MODULES)


def test_what_the_driver_loop_asks_of_the_store_table_each_turn_makes_no_store_call():
    store_calls = {name for name, _ in inspect.getmembers(EtcdStore, inspect.isfunction) if not name.startswith("__")}
    assert {"put", "read_all", "probe", "call", "watch"} <= store_calls
    for method in (StoreTable.poll, StoreTable._table):
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
        called = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        assert called, method.__name__
        assert not called & store_calls, (method.__name__, sorted(called & store_calls))
