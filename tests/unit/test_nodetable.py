"""The head's node table: joins, heartbeats, deaths, and drains of failure domains."""

from __future__ import annotations

import pytest

from outlast.cluster.nodetable import HeadNodeTable, UnknownNode
from outlast.protocol.messages import NodeInfo


def _node(node_id: str, domain: str = "", head: bool = False) -> NodeInfo:
    return NodeInfo(node_id=node_id, address=f"tcp://{node_id}:1", host=node_id, resources={"CPU": 4},
                    failure_domain=domain, is_head=head)


def _table(*nodes: NodeInfo, timeout: float = 5.0) -> HeadNodeTable:
    t = HeadNodeTable(timeout)
    for n in nodes:
        t.register(n, now=0.0, now_unix=1000.0)
    return t


def test_a_silent_member_is_declared_dead_once_and_the_head_never():
    t = _table(_node("h", head=True), _node("a"), _node("b"))
    assert t.heartbeat("a", {}, None, now=4.0, now_unix=1004.0)
    assert [n.node_id for n in t.expire(now=5.5)] == ["b"]
    assert t.expire(now=6.0) == []  # declared once
    assert {n.node_id: n.state for n in t.nodes()} == {"h": "alive", "a": "alive", "b": "dead"}
    assert [n.node_id for n in t.expire(now=9.5)] == ["a"]


def test_a_dead_node_must_register_again_and_then_is_alive():
    t = _table(_node("a"))
    t.expire(now=10.0)
    assert not t.heartbeat("a", {}, None, now=11.0, now_unix=1011.0)
    assert not t.heartbeat("stranger", {}, None, now=11.0, now_unix=1011.0)
    t.register(_node("a"), now=11.0, now_unix=1011.0)
    assert t.get("a").state == "alive"


def test_heartbeats_carry_what_each_run_holds():
    t = _table(_node("a"))
    t.heartbeat("a", {"run1": {"CPU": 2.0}}, None, now=1.0, now_unix=1001.0)
    assert t.get("a").used == {"run1": {"CPU": 2.0}}


def test_a_drain_marks_the_whole_failure_domain_with_one_deadline():
    t = _table(_node("a", "slice-1"), _node("b", "slice-1"), _node("c", "slice-2"), _node("d"))
    order = t.drain("b", "preemption", "spot", deadline_unix_s=1020.0)
    assert order.notice.node_ids == ["b", "a"]  # the drained node first
    assert order.notice.deadline_unix_s == 1020.0
    assert {n.node_id: n.state for n in t.nodes()} == {"a": "draining", "b": "draining", "c": "alive",
                                                          "d": "alive"}
    assert t.drain("d", "maintenance", "", None).notice.node_ids == ["d"]  # no domain: alone


def test_a_member_that_drains_itself_stays_draining_in_the_table():
    t = _table(_node("a"))
    order = t.drain("a", "shutdown", "SIGTERM", 1030.0)
    t.heartbeat("a", {}, None, now=1.0, now_unix=1001.0)  # a heartbeat without the notice keeps it
    assert t.get("a").state == "draining" and t.get("a").draining == order.notice


def test_draining_an_unknown_node_names_the_known_ones():
    t = _table(_node("a"), _node("b"))
    with pytest.raises(UnknownNode, match="no node 'x' in this cluster; its nodes are: a, b"):
        t.drain("x", "preemption", "", None)
