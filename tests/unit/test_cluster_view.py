"""The driver's view of the cluster: what each node can give a run, drains heard of, lost nodes."""

from __future__ import annotations

import pytest
import zmq

from outlast.controller.nodes import LOST_NODE_QUARANTINE_S, Cluster
from outlast.protocol import messages as m


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def cluster():
    ctx = zmq.Context()
    clock = Clock()
    c = Cluster(ctx, "tcp://127.0.0.1:9", None, clock)  # nothing listens there; no query is answered
    c.nodes = {n.node_id: n for n in (
        m.NodeInfo(node_id="a", address="tcp://a:1", host="a", resources={"CPU": 4.0}, is_head=True,
                   used={"other-run": {"CPU": 3.0}, "this-run": {"CPU": 1.0}}),
        m.NodeInfo(node_id="b", address="tcp://b:1", host="b", resources={"CPU": 4.0}),
        m.NodeInfo(node_id="c", address="tcp://c:1", host="c", resources={"CPU": 4.0}, state="dead"),
    )}
    yield c, clock
    c.close(0)
    ctx.term()


def test_a_node_offers_what_other_runs_do_not_hold_and_dead_nodes_offer_nothing(cluster):
    c, _ = cluster
    views = {v.node_id: v for v in c.views("this-run")}
    assert set(views) == {"a", "b"}
    assert views["a"].resources == {"CPU": 1.0}  # this run's own workers go when it is placed again
    assert views["b"].resources == {"CPU": 4.0} and not views["b"].draining


def test_a_drain_heard_from_a_node_survives_an_older_table_until_the_node_dies(cluster):
    c, _ = cluster
    c.note_draining(m.NodeDraining(node_id="b", reason="shutdown", message="SIGTERM", deadline_unix_s=None,
                                   node_ids=["b"]))
    assert {v.node_id: v.draining for v in c.views("r")}["b"]
    c.nodes["b"] = m.NodeInfo(node_id="b", address="tcp://b:1", host="b", resources={"CPU": 4.0})  # older news
    c._overlay_drains()
    assert c.nodes["b"].state == "draining"
    c.nodes["b"] = m.NodeInfo(node_id="b", address="tcp://b:1", host="b", resources={"CPU": 4.0}, state="dead")
    c._overlay_drains()
    c.nodes["b"] = m.NodeInfo(node_id="b", address="tcp://b:1", host="b", resources={"CPU": 4.0})  # came back
    c._overlay_drains()
    assert c.nodes["b"].state == "alive"


def test_a_node_this_driver_lost_gets_no_work_for_a_while_even_if_the_head_still_lists_it(cluster):
    c, clock = cluster
    c.lose("b")
    assert "b" not in {v.node_id for v in c.views("r")}
    clock.now += LOST_NODE_QUARANTINE_S + 1
    assert "b" in {v.node_id for v in c.views("r")}


def test_silence_while_the_driver_itself_was_busy_does_not_count_against_a_node(cluster):
    c, clock = cluster
    link = c.link("b")
    clock.now += 0.1
    c.note_tick(clock.now)
    clock.now += 4.0  # the driver was blocked (a slow storage write, say)
    c.note_tick(clock.now)
    assert c.lost_nodes(clock.now, {"b"}) == {}
    for _ in range(int((c.node_timeout_s + 0.5) / 0.1)):  # ticking normally, and no answer from b
        clock.now += 0.1
        c.note_tick(clock.now)
    assert "stopped answering" in c.lost_nodes(clock.now, {"b"})["b"]
    assert link.address == "tcp://b:1"
