"""The head and member roles answer the same questions, each its own way (no socket needed for
the head; the member's drain refusal needs none either)."""

from __future__ import annotations

import os

import msgspec

from outlast.agent.roles import HeadNode, MemberNode
from outlast.protocol import messages as m


def _info(node_id: str, domain: str = "") -> m.NodeInfo:
    return m.NodeInfo(node_id=node_id, address=f"tcp://127.0.0.1:{7000 + len(node_id)}", host="127.0.0.1",
                      resources={"CPU": 2.0}, failure_domain=domain, agent_pid=os.getpid())


def _drain(node_id: str, left: float | None = 20.0) -> m.DrainNode:
    return m.DrainNode(node_id=node_id, reason="preemption", message="test", deadline_remaining_s=left)


def test_a_drain_on_the_head_fans_out_to_its_failure_domain():
    head = HeadNode("h", node_timeout_s=5.0)
    head.join(_info("h", domain="slice-a"))
    head.on_peer(b"id-m1", m.RegisterNode(node=_info("m1", domain="slice-a")), now=0.0)
    head.on_peer(b"id-m2", m.RegisterNode(node=_info("m2", domain="slice-b")), now=0.0)
    applied, sent = [], []
    ack = head.drain(_drain("m1"), lambda notice: applied.append(notice) or 3, lambda to, msg: sent.append((to, msg)))
    assert isinstance(ack, m.DrainAck) and ack.node_ids == ["m1", "h"] and ack.runs_notified == 3
    assert [to for to, _ in sent] == [b"id-m1"] and sent[0][1].node_ids == ["m1", "h"]
    assert len(applied) == 1 and applied[0].deadline_unix_s is not None
    me = msgspec.structs.replace(_info("h", domain="slice-a"), draining=applied[0])  # as the agent says of itself
    states = {n.node_id: n.state for n in head.nodes(me, 1.0)}
    assert states == {"h": "draining", "m1": "draining", "m2": "alive"}


def test_the_head_refuses_a_drain_of_a_node_it_does_not_know():
    head = HeadNode("h", node_timeout_s=5.0)
    head.join(_info("h"))
    refused = head.drain(_drain("nope"), lambda n: 0, lambda to, msg: None)
    assert isinstance(refused, m.DrainRefused) and "no node 'nope'" in refused.reason


def test_a_silent_member_is_declared_dead_and_a_heartbeat_of_a_dead_one_asks_it_to_register():
    head = HeadNode("h", node_timeout_s=5.0)
    head.join(_info("h"))
    head.on_peer(b"id-m1", m.RegisterNode(node=_info("m1")), now=0.0)
    head.tick(_info("h"), now=10.0)
    assert {n.node_id: n.state for n in head.nodes(_info("h"), 10.0)}["m1"] == "dead"
    ack = head.on_peer(b"id-m1", m.NodeHeartbeat(node_id="m1", used={}, draining=None), now=11.0)
    assert ack == m.HeartbeatAck(known=False)


def test_a_member_refuses_to_drain_another_node_and_names_the_head():
    member = MemberNode.__new__(MemberNode)  # no connection needed for this answer
    member.node_id, member.head_address = "m1", "tcp://10.0.0.1:6380"
    refused = member.drain(_drain("m2"), lambda n: 0, lambda to, msg: None)
    assert isinstance(refused, m.DrainRefused) and "tcp://10.0.0.1:6380" in refused.reason
    applied = []
    ack = member.drain(_drain("m1", left=None), lambda n: applied.append(n) or 1, lambda to, msg: None)
    assert ack.node_ids == ["m1"] and applied[0].deadline_unix_s is None
    assert member.nodes(_info("m1"), 0.0) == [_info("m1")]
