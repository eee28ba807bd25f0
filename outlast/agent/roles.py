"""An agent's place in the cluster: the head keeps the node table, a member reports to it.

The head answers `RegisterNode`, `NodeHeartbeat` and `ListNodes` on its own socket and
declares a silent member dead. A member holds one connection to the head: it registers,
sends a heartbeat every `interval_s` (what its workers hold, whether it is draining),
registers again when the head has forgotten it, and takes drain orders on the same
connection. Both are driven by the agent's poll loop; neither has a thread.

The agent holds one `NodeRole`, a `HeadNode` or a `MemberNode`, and asks it, never
which one it is.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

import zmq

from outlast.client.liveness import agent_gone
from outlast.cluster.nodetable import HeadNodeTable, UnknownNode
from outlast.protocol import messages as m
from outlast.protocol.auth import AuthError, ClusterKey, connect_checked
from outlast.protocol.transport import HEAD_TO_MEMBER, encode, receive_all, send_or_drop, tune

log = logging.getLogger("outlast.agent")

HEARTBEAT_INTERVAL_S = 0.5

ApplyDrain = Callable[[m.NodeDraining], int]  # drain this node; returns how many runs were told
SendTo = Callable[[bytes, m.Msg], None]


class NodeRole(Protocol):
    @property
    def is_head(self) -> bool: ...

    @property
    def head_address(self) -> str: ...  # "" on the head

    @property
    def sock(self) -> zmq.Socket[bytes] | None: ...  # a socket the poll loop watches, or None

    def join(self, me: m.NodeInfo) -> None: ...

    def on_peer(self, identity: bytes, req: m.RegisterNode | m.NodeHeartbeat, now: float) -> m.Msg | None: ...

    def nodes(self, me: m.NodeInfo, now: float) -> list[m.NodeInfo]: ...

    def drain(self, req: m.DrainNode, apply_here: ApplyDrain, send: SendTo) -> m.DrainAck | m.DrainRefused: ...

    def tick(self, me: m.NodeInfo, now: float) -> list[m.NodeDraining]: ...

    def drained_here(self) -> None: ...

    def store_health(self) -> m.StoreHealth | None: ...  # None: the cluster lives in the head alone

    def close(self) -> None: ...


class HeadNode:
    """Keeps the node table; drains fan out from here to every node of a failure domain."""

    is_head = True
    head_address = ""
    sock = None

    def __init__(self, node_id: str, node_timeout_s: float) -> None:
        self.node_id = node_id
        self.table = HeadNodeTable(node_timeout_s)
        self.members: dict[str, bytes] = {}  # node id -> the member's identity on the head's socket

    def join(self, me: m.NodeInfo) -> None:
        self.table.register(me, time.monotonic(), time.time())  # drains of the head's own node find it

    def on_peer(self, identity: bytes, req: m.RegisterNode | m.NodeHeartbeat, now: float) -> m.Msg | None:
        if isinstance(req, m.RegisterNode):
            return self._on_register(identity, req, now)
        self.members[req.node_id] = identity
        return m.HeartbeatAck(known=self.table.heartbeat(req.node_id, req.used, req.draining, now, time.time()))

    def _on_register(self, identity: bytes, req: m.RegisterNode, now: float) -> m.HeartbeatAck:
        known = self.table.get(req.node.node_id)
        self.table.register(req.node, now, time.time())
        self.members[req.node.node_id] = identity
        log.info("node %s %s the cluster (%s, %s)", req.node.node_id,
                 "rejoined" if known is not None else "joined", req.node.address,
                 ", ".join(f"{k} {v:g}" for k, v in sorted(req.node.resources.items())))
        return m.HeartbeatAck(known=True)

    def nodes(self, me: m.NodeInfo, now: float) -> list[m.NodeInfo]:
        self.table.register(me, now, time.time())
        return self.table.nodes()

    def drain(self, req: m.DrainNode, apply_here: ApplyDrain, send: SendTo) -> m.DrainAck | m.DrainRefused:
        """Drain the node and its failure domain: this node applies it, members hear of it."""
        deadline = time.time() + req.deadline_remaining_s if req.deadline_remaining_s is not None else None
        try:
            notice = self.table.drain(req.node_id, req.reason, req.message, deadline, req.also,
                                      req.until_commit).notice
        except UnknownNode as e:
            return m.DrainRefused(reason=str(e))
        notified = 0
        for node_id in notice.node_ids:
            if node_id == self.node_id:
                notified += apply_here(notice)
            elif node_id in self.members:
                send(self.members[node_id], notice)
        return m.DrainAck(node_id=req.node_id, runs_notified=notified, node_ids=notice.node_ids)

    def tick(self, me: m.NodeInfo, now: float) -> list[m.NodeDraining]:
        for node in self.table.expire(now):
            log.warning("node %s (%s) stopped answering for more than %.1f s: declared dead", node.node_id,
                        node.address, self.table.node_timeout_s)
        for node in self.table.nodes():
            why = agent_gone(node) if node.state != "dead" and node.node_id != self.node_id else None
            if why and self.table.declare_dead(node.node_id) is not None:
                log.warning("%s: declared dead", why)
        return []

    def drained_here(self) -> None:
        pass

    def store_health(self) -> None:
        return None

    def close(self) -> None:
        pass


class MemberNode:
    """A member agent: one connection to the head, heartbeats on it, drain orders from it."""

    is_head = False

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], head_address: str, key: ClusterKey | None, node_id: str) -> None:
        self.node_id = node_id
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

    def on_peer(self, identity: bytes, req: m.RegisterNode | m.NodeHeartbeat, now: float) -> m.Msg | None:
        node = req.node.node_id if isinstance(req, m.RegisterNode) else req.node_id
        log.warning("node %s sent a %s to a member agent; only the head at %s keeps the node table", node,
                    type(req).__name__, self.head_address)
        return None

    def nodes(self, me: m.NodeInfo, now: float) -> list[m.NodeInfo]:
        return [me]

    def drain(self, req: m.DrainNode, apply_here: ApplyDrain, send: SendTo) -> m.DrainAck | m.DrainRefused:
        if req.node_id != self.node_id or set(req.also) - {self.node_id}:
            return m.DrainRefused(reason=f"this agent ({self.node_id}) is a member, not the head; send the "
                                         f"drain to the head at {self.head_address}")
        deadline = time.time() + req.deadline_remaining_s if req.deadline_remaining_s is not None else None
        notice = m.NodeDraining(node_id=self.node_id, reason=req.reason, message=req.message,
                                deadline_unix_s=deadline, node_ids=[self.node_id], until_commit=req.until_commit)
        return m.DrainAck(node_id=self.node_id, runs_notified=apply_here(notice), node_ids=notice.node_ids)

    def tick(self, me: m.NodeInfo, now: float) -> list[m.NodeDraining]:
        received = self.receive()
        if any(isinstance(o, m.HeartbeatAck) and not o.known for o in received):
            # The head restarted (its table is new) or declared this node dead: register again.
            log.warning("the head at %s does not know this node; registering again", self.head_address)
            send_or_drop(self.sock, m.RegisterNode(node=me))  # lost: the next heartbeat's answer asks again
        self._heartbeat_if_due(now, me)
        return [o for o in received if isinstance(o, m.NodeDraining)]

    def drained_here(self) -> None:
        self.next_heartbeat = 0.0  # the head learns of it on the loop's next turn

    def store_health(self) -> None:
        return None

    def _heartbeat_if_due(self, now: float, me: m.NodeInfo) -> None:
        if now < self.next_heartbeat:
            return
        self.next_heartbeat = now + HEARTBEAT_INTERVAL_S
        # Lost on a full queue (the head gone): the next goes out in HEARTBEAT_INTERVAL_S.
        send_or_drop(self.sock, m.NodeHeartbeat(node_id=me.node_id, used=me.used, draining=me.draining))
        if now - self.last_ack > 5.0 and not self.head_lost_logged:
            log.warning("no answer from the head at %s for %.0f s; its workers go on, and this node rejoins "
                        "when the head is back", self.head_address, now - self.last_ack)
            self.head_lost_logged = True

    def receive(self) -> list[m.HeadToMember]:
        out = []
        for _, msg in receive_all(self.sock, HEAD_TO_MEMBER, "message from the head"):
            out.append(msg)
            self.last_ack, self.head_lost_logged = time.monotonic(), False
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


__all__ = ["HeadNode", "MemberNode", "NodeRole", "HEARTBEAT_INTERVAL_S"]
