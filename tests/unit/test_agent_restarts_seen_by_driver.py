"""A node's agent started again with the same node id: the driver's node book loses the old agent's
workers, offers the node again once it sees the new agent, and an agent refuses a spawn placed on
another (pure: no processes)."""

from __future__ import annotations

from outlast.agent.supervisor import spawn_refusal
from outlast.controller.nodes import NodeBook
from outlast.protocol import messages as m


def _node(pid: int, state: str = "alive") -> m.NodeInfo:
    return m.NodeInfo(node_id="n1", address="tcp://n1:1", host="n1", resources={"CPU": 1.0}, agent_pid=pid,
                      state=state)


def test_a_node_whose_agent_is_gone_gets_no_ranks_until_the_table_shows_a_new_agent():
    book = NodeBook()
    book.set_table([_node(100)])
    book.note_gone("n1", "the node agent of node n1 (pid 100) is gone")
    assert book.views("r", 0.0) == []  # the head's table still says alive: the driver knows better
    book.set_table([_node(200)])
    assert [v.node_id for v in book.views("r", 1.0)] == ["n1"]
    book.link("n1", 1.0)
    assert book.lost_nodes(2.0, {"n1"}) == {}  # the new ranks are on the new agent


def test_a_linked_node_answering_from_another_agent_lost_the_old_ones_workers():
    book = NodeBook()
    book.set_table([_node(100)])
    book.link("n1", 0.0)
    book.note_pid("n1", 100)
    assert book.lost_nodes(1.0, {"n1"}) == {}
    book.note_pid("n1", 200)  # started again within the node timeout: it answers, but its workers are gone
    why = book.lost_nodes(1.0, {"n1"})["n1"]
    assert "started again (pid 100, now 200)" in why
    book.lose("n1", 1.0)
    book.set_table([_node(200)])
    assert [v.node_id for v in book.views("r", 2.0)] == ["n1"]  # only the old agent is kept out


def test_placing_binds_the_node_to_the_agent_in_the_table():
    book = NodeBook()
    book.set_table([_node(100)])
    book.link("n1", 0.0)
    book.set_table([_node(200)])  # a later placement, on the agent started since
    book.link("n1", 1.0)
    book.note_pid("n1", 200)
    assert book.lost_nodes(2.0, {"n1"}) == {}


def test_a_node_whose_agent_was_started_again_while_it_held_no_ranks_is_not_lost_the_moment_ranks_go_there():
    # Found by the chaos harness: a drained node's agent was stopped and started again while the run
    # trained elsewhere; the next attempt placed a rank there and lost it at once, "silent for 9 s",
    # counting the silence from the old agent's last answer.
    book = NodeBook(node_timeout_s=2.0)
    book.set_table([_node(100)])
    assert book.link("n1", 0.0)
    book.note_pid("n1", 100)
    book.set_table([_node(200)])  # the old agent stopped; a new one joined, and this run held nothing there
    assert book.link("n1", 9.0)  # new to the run: it gets the run's heartbeat first
    assert book.lost_nodes(9.5, {"n1"}) == {}
    assert "silent for" in book.lost_nodes(11.5, {"n1"})["n1"]  # and it is judged from its placement on
    assert not book.link("n1", 12.0)  # the same agent again: nothing new


def test_an_agent_refuses_a_spawn_placed_on_another_or_while_draining():
    notice = m.NodeDraining(node_id="n1", reason="spot", message="going", deadline_unix_s=None, node_ids=["n1"])
    assert spawn_refusal("n1", None, 100, 100) is None
    assert spawn_refusal("n1", None, 0, 100) is None  # a controller that names no agent
    assert "started again (pid 100, now 200)" in spawn_refusal("n1", None, 100, 200)
    assert "draining (spot: going)" in spawn_refusal("n1", notice, 100, 100)
