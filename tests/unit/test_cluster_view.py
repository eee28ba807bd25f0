"""The driver's view of the cluster: what each node can give a run, drains heard of, lost nodes."""

from __future__ import annotations

import pytest

from outlast.controller.nodes import LOST_NODE_QUARANTINE_S, NodeBook
from outlast.protocol import messages as m

B = m.NodeInfo(node_id="b", address="tcp://b:1", host="b", resources={"CPU": 4.0})


@pytest.fixture
def book():
    b = NodeBook(node_timeout_s=5.0)
    b.set_table([
        m.NodeInfo(node_id="a", address="tcp://a:1", host="a", resources={"CPU": 4.0}, is_head=True,
                   used={"other-run": {"CPU": 3.0}, "this-run": {"CPU": 1.0}}),
        B,
        m.NodeInfo(node_id="c", address="tcp://c:1", host="c", resources={"CPU": 4.0}, state="dead"),
    ])
    return b


def test_a_node_offers_what_other_runs_do_not_hold_and_dead_nodes_offer_nothing(book):
    views = {v.node_id: v for v in book.views("this-run", now=100.0)}
    assert set(views) == {"a", "b"}
    assert views["a"].resources == {"CPU": 1.0}  # this run's own workers go when it is placed again
    assert views["b"].resources == {"CPU": 4.0} and not views["b"].draining


def test_a_drain_heard_from_a_node_survives_an_older_table_until_the_node_dies(book):
    book.note_draining(m.NodeDraining(node_id="b", reason="shutdown", message="SIGTERM", deadline_unix_s=None,
                                      node_ids=["b"]))
    assert {v.node_id: v.draining for v in book.views("r", now=100.0)}["b"]
    book.set_table([B])  # older news
    assert book.nodes["b"].state == "draining"
    book.set_table([m.NodeInfo(node_id="b", address="tcp://b:1", host="b", resources={"CPU": 4.0}, state="dead")])
    book.set_table([B])  # came back
    assert book.nodes["b"].state == "alive"


def test_a_node_this_driver_lost_gets_no_work_for_a_while_even_if_the_head_still_lists_it(book):
    book.lose("b", now=100.0)
    assert "b" not in {v.node_id for v in book.views("r", now=100.0)}
    assert "b" in {v.node_id for v in book.views("r", now=100.0 + LOST_NODE_QUARANTINE_S + 1)}


def test_silence_while_the_driver_itself_was_busy_does_not_count_against_a_node(book):
    now = 100.0
    book.link("b", now)
    book.note_tick(now)
    now += 4.0  # the driver was blocked (a slow storage write, say)
    book.note_tick(now)
    assert book.lost_nodes(now, {"b"}) == {}
    for _ in range(int((book.node_timeout_s + 0.5) / 0.1)):  # ticking normally, and no answer from b
        now += 0.1
        book.note_tick(now)
    assert "stopped answering" in book.lost_nodes(now, {"b"})["b"]


def test_a_node_whose_agent_is_known_gone_is_lost_at_once_and_a_dead_one_too(book):
    book.link("b", 100.0)
    book.note_gone("b", "the node agent at tcp://b:1 exited")
    assert book.lost_nodes(100.0, {"b", "c"}) == {"b": "the node agent at tcp://b:1 exited",
                                                 "c": "the head declared node c (tcp://c:1) dead"}


def test_a_dead_node_whose_agent_is_known_gone_is_lost_with_why_its_agent_went(book):
    # The head may declare it dead first, from the same process table: its "dead" says less than the reason.
    book.note_gone("c", "the node agent of node c (pid 42) is gone from this machine")
    assert book.lost_nodes(100.0, {"c"}) == {"c": "the node agent of node c (pid 42) is gone from this machine"}
