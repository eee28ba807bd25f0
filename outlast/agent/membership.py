"""An agent's place in the cluster: the head keeps the node table, a member reports to it.

The head answers `RegisterNode`, `NodeHeartbeat` and `ListNodes` on its own socket and
declares a silent member dead. A member holds one connection to the head: it registers,
sends a heartbeat every `interval_s` (what its workers hold, whether it is draining),
registers again when the head has forgotten it, and takes drain orders on the same
connection. Both are driven by the agent's poll loop; neither has a thread.
"""

from __future__ import annotations

import logging
import time

import zmq

from outlast.cluster.nodetable import NodeTable, UnknownNode
from outlast.protocol import messages as m
from outlast.protocol.auth import AuthError, ClusterKey, connect_checked
from outlast.protocol.transport import HEAD_TO_MEMBER, BadMessage, tune, encode

log = logging.getLogger("outlast.agent")

HEARTBEAT_INTERVAL_S = 0.5


class HeadRole:
    def __init__(self, node_timeout_s: float) -> None:
        self.table = NodeTable(node_timeout_s)
        self.members: dict[str, bytes] = {}  # node id -> the member's identity on the head's socket

    def on_register(self, identity: bytes, req: m.RegisterNode, now: float) -> m.HeartbeatAck:
        known = self.table.get(req.node.node_id)
        self.table.register(req.node, now, time.time())
        self.members[req.node.node_id] = identity
        log.info("node %s %s the cluster (%s, %s)", req.node.node_id,
                 "rejoined" if known is not None else "joined", req.node.address,
                 ", ".join(f"{k} {v:g}" for k, v in sorted(req.node.resources.items())))
        return m.HeartbeatAck(known=True)

    def on_heartbeat(self, identity: bytes, req: m.NodeHeartbeat, now: float) -> m.HeartbeatAck:
        self.members[req.node_id] = identity
        return m.HeartbeatAck(known=self.table.heartbeat(req.node_id, req.used, req.draining, now, time.time()))

    def refresh_self(self, me: m.NodeInfo, now: float) -> None:
        self.table.register(me, now, time.time())

    def expire(self, now: float) -> None:
        for node in self.table.expire(now):
            log.warning("node %s (%s) stopped answering for more than %.1f s: declared dead", node.node_id,
                        node.address, self.table.node_timeout_s)

    def drain(self, req: m.DrainNode) -> m.NodeDraining:
        """Raises `UnknownNode`; the caller tells the listed nodes."""
        deadline = time.time() + req.deadline_remaining_s if req.deadline_remaining_s is not None else None
        return self.table.drain(req.node_id, req.reason, req.message, deadline).notice


class MemberLink:
    """A member agent's connection to the head."""

    def __init__(self, ctx: zmq.Context, head_address: str, key: ClusterKey | None, node_id: str) -> None:
        self.head_address = head_address
        self.sock = tune(ctx.socket(zmq.DEALER))
        self.sock.setsockopt(zmq.IDENTITY, f"member:{node_id}".encode())
        if key is not None:
            key.connect_as_client(self.sock)
            connect_checked(self.sock, head_address, timeout_ms=10_000)
        else:
            self.sock.connect(head_address)
        self.next_heartbeat = 0.0
        self.last_ack = time.monotonic()
        self.head_lost_logged = False

    def join(self, me: m.NodeInfo, timeout_s: float = 10.0) -> None:
        """Register and wait for the head's answer; raise `AuthError` when none comes."""
        self.sock.send(encode(m.RegisterNode(node=me)))
        if not self.sock.poll(int(timeout_s * 1000)):
            raise AuthError(f"the head at {self.head_address} did not answer within {timeout_s:.0f} s; is "
                            "`outlast start` running there, is the address right, and is this the cluster's key?")
        self.receive()  # the ack

    def heartbeat_if_due(self, now: float, me: m.NodeInfo) -> None:
        if now < self.next_heartbeat:
            return
        self.next_heartbeat = now + HEARTBEAT_INTERVAL_S
        try:
            self.sock.send(encode(m.NodeHeartbeat(node_id=me.node_id, used=me.used, draining=me.draining)),
                           zmq.NOBLOCK)
        except zmq.Again:
            pass
        if now - self.last_ack > 5.0 and not self.head_lost_logged:
            log.warning("no answer from the head at %s for %.0f s; its workers go on, and this node rejoins "
                        "when the head is back", self.head_address, now - self.last_ack)
            self.head_lost_logged = True

    def receive(self) -> list[m.HeadToMember]:
        out = []
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(HEAD_TO_MEMBER.decode(data))
            except BadMessage as e:
                log.warning("dropped a malformed message from the head: %s", e)
                continue
            self.last_ack, self.head_lost_logged = time.monotonic(), False

    def close(self) -> None:
        self.sock.close(linger=0)


__all__ = ["HeadRole", "MemberLink", "UnknownNode", "HEARTBEAT_INTERVAL_S"]
