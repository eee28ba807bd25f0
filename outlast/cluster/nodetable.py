"""The head's table of nodes: who is alive, who is draining and until when, who is dead.

Pure: the time comes in as an argument and every method returns what changed, so the
head's effects (telling a member to drain, logging a death) stay in the agent.
A node that stops sending heartbeats for `node_timeout_s` is dead; one that comes
back registers again and is alive. A drain on one node of a failure domain drains
every node of that domain, with the same deadline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from outlast.protocol.messages import NodeDraining, NodeInfo


@dataclass(frozen=True)
class NodesToDrain:
    """Drain these nodes (the head tells each member agent; it drains itself if listed)."""

    notice: NodeDraining  # with `node_ids` naming every node drained together


class UnknownNode(KeyError):
    def __init__(self, node_id: str, known: list[str]) -> None:
        super().__init__(node_id)
        self.message = (f"no node {node_id!r} in this cluster; its nodes are: {', '.join(known) or 'none'} "
                        "(`outlast status` on the head lists them)")

    def __str__(self) -> str:
        return self.message


class HeadNodeTable:
    def __init__(self, node_timeout_s: float) -> None:
        self.node_timeout_s = node_timeout_s
        self._nodes: dict[str, NodeInfo] = {}
        self._last_seen: dict[str, float] = {}  # monotonic

    def register(self, node: NodeInfo, now: float, now_unix: float) -> None:
        """A new node, or one coming back (after a restart of it or of the head)."""
        self._nodes[node.node_id] = msgspec.structs.replace(
            node, state="draining" if node.draining is not None else "alive", last_seen_unix=now_unix)
        self._last_seen[node.node_id] = now

    def heartbeat(self, node_id: str, used: dict[str, dict[str, float]], draining: NodeDraining | None,
                  now: float, now_unix: float) -> bool:
        """Record a member's heartbeat; False when the node is unknown or was declared dead (re-register)."""
        node = self._nodes.get(node_id)
        if node is None or node.state == "dead":
            return False
        draining = draining or node.draining
        self._nodes[node_id] = msgspec.structs.replace(
            node, used=used, draining=draining, state="draining" if draining is not None else "alive",
            last_seen_unix=now_unix)
        self._last_seen[node_id] = now
        return True

    def expire(self, now: float) -> list[NodeInfo]:
        """Declare dead every node silent for longer than the timeout; return those just declared."""
        dead = []
        for node_id, node in self._nodes.items():
            if node.state != "dead" and not node.is_head and now - self._last_seen[node_id] > self.node_timeout_s:
                self._nodes[node_id] = msgspec.structs.replace(node, state="dead", used={})
                dead.append(self._nodes[node_id])
        return dead

    def declare_dead(self, node_id: str) -> NodeInfo | None:
        """A node known to be gone without waiting for its silence; returns it if it was not dead yet."""
        node = self._nodes.get(node_id)
        if node is None or node.state == "dead":
            return None
        self._nodes[node_id] = msgspec.structs.replace(node, state="dead", used={})
        return self._nodes[node_id]

    def drain(self, node_id: str, reason: str, message: str, deadline_unix_s: float | None,
              also: Sequence[str] = (), until_commit: bool = False) -> NodesToDrain:
        """Mark `node_id`, the nodes in `also` and their failure domains as draining, as one drain; raise
        `UnknownNode` for a wrong id, before anything is marked."""
        named = [node_id, *(i for i in also if i != node_id)]
        for i in named:
            if i not in self._nodes:
                raise UnknownNode(i, sorted(self._nodes))
        domains = {self._nodes[i].failure_domain for i in named} - {""}
        ids = [n.node_id for n in self._nodes.values() if n.node_id in named or n.failure_domain in domains]
        ids = [node_id] + sorted(i for i in ids if i != node_id)
        notice = NodeDraining(node_id=node_id, reason=reason, message=message, deadline_unix_s=deadline_unix_s,
                              node_ids=ids, until_commit=until_commit)
        for i in ids:
            n = self._nodes[i]
            if n.state != "dead":
                self._nodes[i] = msgspec.structs.replace(n, state="draining", draining=notice)
        return NodesToDrain(notice)

    def get(self, node_id: str) -> NodeInfo | None:
        return self._nodes.get(node_id)

    def nodes(self) -> list[NodeInfo]:
        return sorted(self._nodes.values(), key=lambda n: (not n.is_head, n.node_id))
