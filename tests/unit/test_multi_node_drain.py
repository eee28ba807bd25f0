"""A drain of several nodes at once is one drain: one notice naming them all, on every node it reaches."""

from __future__ import annotations

import os

import pytest

from outlast.agent.roles import HeadNode, MemberNode
from outlast.cluster.nodetable import HeadNodeTable, UnknownNode
from outlast.protocol import messages as m


def _info(node_id: str, domain: str = "") -> m.NodeInfo:
    return m.NodeInfo(node_id=node_id, address=f"tcp://{node_id}:1", host="127.0.0.1", resources={"CPU": 2.0},
                      failure_domain=domain, agent_pid=os.getpid())


def _drain(node_id: str, also=()) -> m.DrainNode:
    return m.DrainNode(node_id=node_id, also=list(also), reason="preemption", message="Slurm job 7 got SIGUSR1",
                       deadline_remaining_s=30.0)


def test_one_drain_of_several_nodes_and_their_domains_is_one_notice():
    t = HeadNodeTable(5.0)
    for n in (_info("a"), _info("b", "rack-1"), _info("c", "rack-1"), _info("d")):
        t.register(n, now=0.0, now_unix=1000.0)
    notice = t.drain("a", "preemption", "job", 1030.0, also=["b"]).notice
    assert notice.node_id == "a" and notice.node_ids == ["a", "b", "c"]
    assert {n.node_id: n.state for n in t.nodes()} == {"a": "draining", "b": "draining", "c": "draining",
                                                       "d": "alive"}
    assert {n.node_id: n.draining for n in t.nodes() if n.draining} == {i: notice for i in "abc"}


def test_a_wrong_id_among_several_drains_none_of_them():
    t = HeadNodeTable(5.0)
    for n in (_info("a"), _info("b")):
        t.register(n, now=0.0, now_unix=1000.0)
    with pytest.raises(UnknownNode, match="'nope'"):
        t.drain("a", "preemption", "job", None, also=["b", "nope"])
    assert {n.state for n in t.nodes()} == {"alive"}


def test_the_head_tells_itself_and_every_member_the_same_notice_naming_all():
    head = HeadNode("h", node_timeout_s=5.0)
    head.join(_info("h"))
    for i in ("m1", "m2"):
        head.on_peer(f"id-{i}".encode(), m.RegisterNode(node=_info(i)), now=0.0)
    applied, sent = [], []
    ack = head.drain(_drain("h", also=["m1", "m2"]), lambda n: applied.append(n) or 1,
                     lambda to, msg: sent.append((to, msg)))
    assert isinstance(ack, m.DrainAck) and ack.node_ids == ["h", "m1", "m2"]
    assert [n.node_ids for n in applied] == [["h", "m1", "m2"]]
    assert sorted(to for to, _ in sent) == [b"id-m1", b"id-m2"]
    assert [msg for _, msg in sent] == [applied[0], applied[0]]


def test_a_member_refuses_a_drain_that_names_other_nodes_too():
    member = MemberNode.__new__(MemberNode)  # no connection needed for this answer
    member.node_id, member.head_address = "m1", "tcp://10.0.0.1:6380"
    refused = member.drain(_drain("m1", also=["m2"]), lambda n: 0, lambda to, msg: None)
    assert isinstance(refused, m.DrainRefused) and "tcp://10.0.0.1:6380" in refused.reason
