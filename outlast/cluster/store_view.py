"""The cluster as its store (etcd) holds it, rebuilt from a read and the watch events after it.

Pure: keys and values come in, the node table and the duties of whoever holds the head role
come out. Keys, under the cluster's own prefix:

    members/<id>   the node as it joined; stays after it dies, so a node that is gone reads as dead
    nodes/<id>     the node as it is now (what runs hold, whether it drains), bound to its agent's lease
    drains/<id>    the drain of a node (reason, message, deadline), written by whoever was asked to drain it
    dead/<id>      when the head judged the node dead (its lease ended)
    head           the node id of the agent holding the head role, bound to its lease

A node is alive while its leased key exists: etcd, not a head, ends a silent node's lease.
Every value is sealed with the cluster key (`outlast/cluster/sealed.py`); one that fails its
check is refused (kept out of the view, listed in `refused` with why).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from outlast.cluster.nodetable import UnknownNode
from outlast.cluster.sealed import Sealer
from outlast.protocol.messages import NodeDraining, NodeInfo

_NODE = msgspec.json.Decoder(NodeInfo)
_DRAIN = msgspec.json.Decoder(NodeDraining)
_encode = msgspec.json.encode


@dataclass(frozen=True)
class StoreEvent:
    """A key under the cluster's prefix was put (`value`) or deleted (`value` None)."""

    key: str
    value: bytes | None


@dataclass(frozen=True)
class PutDrain:
    """Drain `node_id` too: it shares a failure domain with a node that drains."""

    node_id: str
    notice: NodeDraining


@dataclass(frozen=True)
class RecordDeath:
    """`node_id`'s lease ended: record when, once."""

    node_id: str
    at_unix: float


Duty = PutDrain | RecordDeath


class ClusterView:
    def __init__(self, sealer: Sealer | None = None) -> None:
        self.sealer = sealer
        self.members: dict[str, NodeInfo] = {}
        self.live: dict[str, NodeInfo] = {}
        self.drains: dict[str, NodeDraining] = {}
        self.dead: dict[str, float] = {}
        self.head: str | None = None
        self.malformed: list[str] = []  # keys whose values could not be read (kept out of the table)
        self.refused: list[tuple[str, str]] = []  # (key, why): values whose seal failed (kept out too)

    def reset(self, items: list[tuple[str, bytes]]) -> None:
        """A full read of the prefix: what the watch then continues from."""
        ClusterView.__init__(self, self.sealer)
        for key, value in items:
            self.apply(StoreEvent(key, value))

    def apply(self, event: StoreEvent) -> bool:
        """Take one watch event; True when the table or the head changed."""
        kind, _, node_id = event.key.partition("/")
        books: dict[str, dict[str, NodeInfo] | dict[str, NodeDraining] | dict[str, float]] = {
            "members": self.members, "nodes": self.live, "drains": self.drains, "dead": self.dead}
        if event.key != "head" and (kind not in books or not node_id):
            return False
        value = event.value
        if value is not None and self.sealer is not None:
            value, why = self.sealer.open(event.key, value)
            if value is None:
                self.refused.append((event.key, why))
                return False
        if event.key == "head":
            try:
                head = value.decode() if value is not None else None
            except UnicodeDecodeError:
                self.malformed.append(event.key)
                return False
            old, self.head = self.head, head
            return old != self.head
        if value is None:
            return books[kind].pop(node_id, None) is not None
        try:
            if kind == "members":
                self.members[node_id] = _NODE.decode(value)
            elif kind == "nodes":
                self.live[node_id] = _NODE.decode(value)
            elif kind == "drains":
                self.drains[node_id] = _DRAIN.decode(value)
            else:
                self.dead[node_id] = float(value)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            self.malformed.append(event.key)
            return False
        return True

    def copy(self) -> "ClusterView":
        out = ClusterView(self.sealer)
        out.members, out.live, out.drains = dict(self.members), dict(self.live), dict(self.drains)
        out.dead, out.head = dict(self.dead), self.head
        return out

    # ---- what it says ---------------------------------------------------------------------

    def table(self) -> list[NodeInfo]:
        """Every node that ever joined: alive, draining or dead, with the head marked."""
        out = []
        for node_id in sorted(set(self.members) | set(self.live)):
            node = self.live.get(node_id) or self.members[node_id]
            drain = self.drains.get(node_id)
            if node_id not in self.live:
                state, used = "dead", {}
            else:
                state, used = ("draining" if drain is not None else "alive"), node.used
            out.append(msgspec.structs.replace(node, state=state, used=used, draining=drain,
                                               is_head=node_id == self.head,
                                               last_seen_unix=self.dead.get(node_id, node.last_seen_unix)))
        return sorted(out, key=lambda n: (not n.is_head, n.node_id))

    def drain_of(self, node_id: str) -> NodeDraining | None:
        return self.drains.get(node_id)

    def domain_of(self, node_id: str, reason: str, message: str, deadline_unix_s: float | None) -> NodeDraining:
        """The notice that drains `node_id` and every live node of its failure domain; `UnknownNode` if none."""
        node = self.live.get(node_id) or self.members.get(node_id)
        if node is None:
            raise UnknownNode(node_id, sorted(set(self.members) | set(self.live)))
        peers = sorted(i for i, n in self.live.items()
                       if i != node_id and node.failure_domain and n.failure_domain == node.failure_domain)
        return NodeDraining(node_id=node_id, reason=reason, message=message, deadline_unix_s=deadline_unix_s,
                            node_ids=[node_id] + peers)

    def head_duties(self, now_unix: float) -> list[Duty]:
        """What the agent holding the head role must write: drains fanned out to failure domains, deaths."""
        out: list[Duty] = []
        for node_id, notice in sorted(self.drains.items()):
            if node_id != notice.node_id:
                continue  # a drain fanned out from another node's: its origin fans out
            if node_id not in self.live:
                # A dead node's drain is over: its peers were drained while it lived, and a peer that
                # rejoins since (a new start, its drain deleted) must not be drained again by it.
                continue
            expanded = self.domain_of(node_id, notice.reason, notice.message, notice.deadline_unix_s)
            for peer in expanded.node_ids[1:]:
                if peer not in self.drains:
                    out.append(PutDrain(peer, msgspec.structs.replace(notice, node_ids=expanded.node_ids)))
        for node_id in sorted(self.members):
            if node_id not in self.live and node_id not in self.dead:
                out.append(RecordDeath(node_id, now_unix))
        return out


def node_value(node: NodeInfo) -> bytes:
    return _encode(node)


def drain_value(notice: NodeDraining) -> bytes:
    return _encode(notice)


__all__ = ["ClusterView", "Duty", "PutDrain", "RecordDeath", "StoreEvent", "drain_value", "node_value"]
