"""The head's loss, as the controller decides it: no table for longer than the node timeout. A run that needs a new
node then (no capacity on those it knows) ends at once, saying why and what to run; one that does not goes on."""

from __future__ import annotations

import msgspec

from outlast.controller import group as g
from outlast.controller.nodes import NodeBook
from outlast.controller.states import State
from outlast.protocol import messages as m
from tests.fakes.controller import make, node, start


def _head(node_id="n1"):
    return msgspec.structs.replace(node(node_id), is_head=True)


def test_the_head_is_lost_once_no_table_came_for_longer_than_the_node_timeout_and_not_before():
    book = NodeBook(node_timeout_s=5.0)
    book.set_table([_head(), node("n2")], now=100.0)
    assert book.head_lost(105.0) is None  # a head started again within the timeout answers in time
    why = book.head_lost(105.5)
    assert why is not None and "head node n1 (tcp://n1:1)" in why and "OUTLAST_NODE_TIMEOUT_S=5" in why
    book.set_table([_head(), node("n2")], now=106.0)  # it answered again
    assert book.head_lost(110.0) is None


def test_the_controllers_own_stall_is_not_the_heads_silence():
    book = NodeBook(node_timeout_s=5.0)
    book.set_table([_head()], now=100.0)
    book.note_tick(100.0)
    book.note_tick(104.0)  # the loop itself stalled for 4 s
    assert book.head_lost(106.0) is None


def test_a_cluster_without_a_head_in_its_table_never_loses_one():
    book = NodeBook(node_timeout_s=5.0)
    book.set_table([node("n1"), node("n2")], now=100.0)  # a cluster in etcd: the driver's own watch
    assert book.head_lost(1000.0) is None


def test_a_run_waiting_for_capacity_whose_head_is_silent_ends_at_once_naming_the_head_and_etcd():
    h = make(nodes=("n1", "n2"), max_failures=1)
    h.step(g.NodeTable([_head("n1"), node("n2")]))
    placement = start(h)
    assert sorted(placement.values()) == ["n1", "n2"]
    # The head's node is lost with its rank; no table comes any more.
    h.step(g.AgentGone("n1", "the node agent of node n1 (pid 7) is gone from this machine"))
    h.agent("n2", h.exited(1, "n2", code=1))
    for _ in range(4):
        h.step(dt=0.5)
    assert h.state is State.WAITING_FOR_CAPACITY  # within the node timeout: it may come back
    for _ in range(12):
        h.step(dt=0.5)
        h.agent("n2", m.Pong(node_id="n2", pid=0))
    assert h.state is State.ERRORED
    error = str(h.core.error)
    assert "head node n1 (tcp://n1:1)" in error and "it is gone" in error
    assert "outlast start --etcd" in error and "docs/operations/etcd.md" in error
    assert "run fit() again with the same RunConfig(name, storage_path)" in error
    assert h.core.book.state.error == error


def test_a_run_that_still_has_room_goes_on_while_its_head_is_silent():
    h = make(nodes=("n1", "n2", "n3"), max_failures=1)
    h.step(g.NodeTable([_head("n1"), node("n2"), node("n3")]))
    placement = start(h)
    assert sorted(placement.values()) == ["n1", "n2"]
    for _ in range(12):  # the head is silent past the node timeout; the run's own nodes answer
        h.step(dt=0.5)
        for n in ("n1", "n2", "n3"):
            h.agent(n, m.Pong(node_id=n, pid=0))
    assert h.core.nodes.head_lost(h.now) is not None
    for rank, n in placement.items():
        h.agent(n, h.exited(rank, n, code=1))
    for _ in range(6):
        h.step(dt=0.5)
    assert h.state is not State.ERRORED and h.core.attempt.number == 2
    assert sorted(h.spawned().values()) == ["n1", "n2"]  # placed on the nodes the last table showed
