"""A driver's node table from the cluster store: nothing is placed on what etcd's minority says.

The store is a fake whose answers the test times: which reads have a majority behind them, and when
the session's probe (its check of the majority) answers.
"""

from __future__ import annotations

import threading
import time

from outlast.cluster.etcd_store import StoreUnavailable
from outlast.cluster.store_session import StoreSession
from outlast.cluster.store_view import node_value
from outlast.controller import group as g
from outlast.controller.store_table import StoreTable
from outlast.protocol.messages import NodeInfo

NODE = NodeInfo(node_id="node-3", address="tcp://10.0.0.3:6380", host="10.0.0.3", resources={"slot": 1.0})


class FakeStore:
    """One member left of three: a read that needs a majority fails, a serializable one answers with
    that member's keys. `probe` waits for the test to say how it ends."""

    sealer = None

    def __init__(self) -> None:
        self.majority = False
        self.probe_may_answer = threading.Event()
        self.watching = threading.Event()
        self._stopped = threading.Event()

    def read_all(self, serializable: bool = False) -> tuple[list[tuple[str, bytes]], int]:
        if not serializable and not self.majority:
            raise StoreUnavailable("no etcd member answered with a majority behind it")
        return [("members/node-3", node_value(NODE)), ("nodes/node-3", node_value(NODE))], 7

    def probe(self) -> None:
        self.probe_may_answer.wait()
        if not self.majority:
            raise StoreUnavailable("no etcd member answered with a majority behind it")

    def watch(self, from_revision: int, on_events: object, stopping: threading.Event) -> None:
        self.watching.set()
        self._stopped.wait()
        self._stopped.clear()

    def stop_watch(self) -> None:
        self._stopped.set()


def table_of(events: list[g.InEvent]) -> list[str] | None:
    tables = [e.nodes for e in events if isinstance(e, g.NodeTable)]
    return [n.node_id for n in tables[-1]] if tables else None


def wait_for(what, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not (out := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return out


def test_a_table_read_from_one_member_is_not_placed_on_even_before_the_probe_says_the_majority_is_gone():
    store = FakeStore()
    table = StoreTable(StoreSession(store, lambda _view: store.probe(), interval_s=0.05))  # type: ignore[arg-type]
    try:
        # The watch thread's read fell back to the lone member's own keys while the probe has not answered
        # yet (a loaded machine: both calls time out together, and either thread may run first).
        assert table.nodes(timeout_s=5.0) == []
        assert table_of(table.poll()) == []
        store.probe_may_answer.set()
        wait_for(lambda: table.session.unavailable_since is not None)
        assert table_of(table.poll()) in ([], None)

        # The majority is back: the probe answers, the watch reads everything again with it, and the
        # node is offered.
        store.majority = True
        assert wait_for(lambda: table_of(table.poll()) == ["node-3"])
    finally:
        store.probe_may_answer.set()
        table.close()


def test_a_table_read_with_a_majority_is_placed_on_at_once():
    store = FakeStore()
    store.majority = True
    table = StoreTable(StoreSession(store, lambda _view: store.probe(), interval_s=0.05))  # type: ignore[arg-type]
    try:
        nodes = table.nodes(timeout_s=5.0)  # the probe has not answered: the read had the majority behind it
        assert nodes is not None and [n.node_id for n in nodes] == ["node-3"]
    finally:
        store.probe_may_answer.set()
        table.close()
