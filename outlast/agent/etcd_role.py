"""The node role of an agent whose cluster lives in etcd: every agent is an equal member of it.

Each agent keeps its node under a key bound to a lease it renews, reads the whole table (drains
included) from a watch, and drains itself when a drain for its node appears, whoever wrote it and
whether or not a head is elected. The head role (fanning a failure-domain drain out, recording a
node whose lease ended as dead) is held by whichever agent created the `head` key with its lease;
when that agent dies its lease ends, the key goes, and the next agent to see it gone takes it.

All calls to etcd run in the store session's threads, except a drain asked of this agent, which is
written before it is acknowledged: the agent's poll loop never waits on a store without a majority.
"""

from __future__ import annotations

import logging
import time

import msgspec

from outlast.agent.roles import ApplyDrain, SendTo
from outlast.cluster.etcd_store import EtcdConfig, EtcdStore, StoreUnavailable, namespace_of
from outlast.cluster.nodetable import UnknownNode
from outlast.cluster.sealed import Sealer
from outlast.cluster.store_session import StoreSession
from outlast.cluster.store_view import ClusterView, PutDrain, RecordDeath, drain_value, node_value
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey

log = logging.getLogger("outlast.agent")


class EtcdNode:
    head_address = ""  # no head to send anything to: the store is the cluster's memory
    sock = None

    def __init__(self, config: EtcdConfig, key: ClusterKey, node_id: str) -> None:
        self.node_id = node_id
        self.ttl_s = config.lease_ttl_s
        self.store = EtcdStore(config, namespace_of(key.public), sealer=Sealer(key.secret))
        self.lease: int | None = None
        self.holding = False
        self._me: m.NodeInfo | None = None  # the latest from the poll loop; the beat writes it
        self._written: bytes | None = None
        self._told: m.NodeDraining | None = None  # the drain of this node already handed to the loop
        self.session = StoreSession(self.store, self._beat, interval_s=min(1.0, self.ttl_s / 3))

    @property
    def is_head(self) -> bool:
        return self.holding

    def join(self, me: m.NodeInfo) -> None:
        """Register with a fresh lease (a restarted node is a new start: no drain, no death), then watch."""
        try:
            self.lease = self.store.grant(self.ttl_s)
            for stale in (f"drains/{self.node_id}", f"dead/{self.node_id}"):
                self.store.delete(stale)
            self.store.put(f"members/{self.node_id}", node_value(_steady(me)))
            self._write(me)
        except StoreUnavailable as e:
            raise StoreUnavailable(f"node {self.node_id} could not join the cluster in etcd at "
                                   f"{', '.join(self.store.config.endpoints)}: {e}. Is etcd running there with "
                                   "a majority of its members, and are the --etcd URLs and credentials right?") from None
        self._me = me
        self.session.start()
        self.session.read_once.wait(5 * self.store.timeout_s)

    def on_peer(self, identity: bytes, req: m.RegisterNode | m.NodeHeartbeat, now: float) -> m.Msg | None:
        node = req.node.node_id if isinstance(req, m.RegisterNode) else req.node_id
        log.warning("node %s sent a %s, but this cluster keeps its table in etcd; start that node with the same "
                    "--etcd URLs", node, type(req).__name__)
        return None

    def nodes(self, me: m.NodeInfo, now: float) -> list[m.NodeInfo]:
        with self.session.lock:
            table = self.session.view.table()
        return table if any(n.node_id == me.node_id for n in table) else [me, *table]

    def drain(self, req: m.DrainNode, apply_here: ApplyDrain, send: SendTo) -> m.DrainAck | m.DrainRefused:
        """Write the drain to etcd; the node drains when its watch sees it, its failure domain once the
        head fans it out. This node's own drain is applied at once, with or without the store."""
        deadline = time.time() + req.deadline_remaining_s if req.deadline_remaining_s is not None else None
        named = [req.node_id, *(i for i in req.also if i != req.node_id)]
        with self.session.lock:
            try:
                notices = [self.session.view.domain_of(i, req.reason, req.message, deadline) for i in named]
            except UnknownNode as e:
                if named != [self.node_id]:
                    return m.DrainRefused(reason=str(e))
                notices = [m.NodeDraining(node_id=self.node_id, reason=req.reason, message=req.message,
                                          deadline_unix_s=deadline, node_ids=[self.node_id])]
        # One drain of several nodes is one notice naming them all, written under each of them.
        ids = [req.node_id] + sorted({i for n in notices for i in n.node_ids} - {req.node_id})
        notice = msgspec.structs.replace(notices[0], node_ids=ids, until_commit=req.until_commit)
        notified = 0
        if self.node_id in named:
            self._told = notice
            notified = apply_here(notice)
        try:
            if self.session.unavailable_since is not None and named != [self.node_id]:
                # Known to be down: refuse now rather than hold this loop (and its runs' heartbeats).
                raise StoreUnavailable(self.session.detail or "no majority")
            for i in named:
                self.store.put(f"drains/{i}", drain_value(notice))
        except StoreUnavailable as e:
            if named != [self.node_id]:
                return m.DrainRefused(reason=f"the cluster store is unavailable ({e}); the drain of {req.node_id} "
                                             "was not recorded: retry once etcd has its majority back, or drain "
                                             "the node at its own agent")
            log.warning("the drain of this node could not be written to etcd (%s); it drains anyway", e)
        return m.DrainAck(node_id=req.node_id, runs_notified=notified, node_ids=notice.node_ids)

    def tick(self, me: m.NodeInfo, now: float) -> list[m.NodeDraining]:
        self._me = me
        with self.session.lock:
            notice = self.session.view.drain_of(self.node_id)
        if notice is None or notice == self._told:
            return []
        self._told = notice
        return [notice]

    def drained_here(self) -> None:
        pass  # the next beat writes the node with its drain

    def store_health(self) -> m.StoreHealth:
        return self.session.health()

    def close(self) -> None:
        self.session.stop()
        if self.lease is not None:
            try:
                self.store.revoke(self.lease)  # a clean stop hands the head role on at once
            except StoreUnavailable:
                pass

    # ---- the beat (the store session's thread) ------------------------------------------

    def _beat(self, view: ClusterView) -> None:
        me = self._me
        assert me is not None  # set by `join` before the session starts
        if self.lease is None or not self.store.keep_alive(self.lease):
            if self.lease is not None:
                log.warning("this node's etcd lease ended (the store was out of reach for longer than %d s); "
                            "registering again", self.ttl_s)
            self.lease, self._written, self.holding = self.store.grant(self.ttl_s), None, False
            self.store.put(f"members/{self.node_id}", node_value(_steady(me)))
        self._write(me)
        if view.head is not None and view.head != self.node_id:
            if self.holding:
                log.warning("node %s holds the head role now", view.head)
            self.holding = False
        elif not self.holding and (view.head is None or view.head == self.node_id):
            if self.store.create("head", self.node_id.encode(), self.lease):
                log.info("this node (%s) holds the head role", self.node_id)
                self.holding = True
        if self.holding:
            self._head_duties(view)

    def _write(self, me: m.NodeInfo | None) -> None:
        if me is None:
            return
        value = node_value(_steady(me))
        if value != self._written:
            self.store.put(f"nodes/{self.node_id}", value, lease=self.lease)
            self._written = value

    def _head_duties(self, view: ClusterView) -> None:
        for duty in view.head_duties(time.time()):
            if isinstance(duty, PutDrain):
                log.warning("node %s drains with %s: they share failure domain", duty.node_id, duty.notice.node_id)
                self.store.put(f"drains/{duty.node_id}", drain_value(duty.notice))
            elif isinstance(duty, RecordDeath):
                member = view.members.get(duty.node_id)
                log.warning("node %s (%s): its agent's etcd lease ended; declared dead", duty.node_id,
                            member.address if member else "?")
                self.store.put(f"dead/{duty.node_id}", repr(duty.at_unix).encode())


def _steady(me: m.NodeInfo) -> m.NodeInfo:
    """The node without what the table derives (state, head), so that a write happens only on a change."""
    return msgspec.structs.replace(me, state="alive", is_head=False, last_seen_unix=0.0)


__all__ = ["EtcdNode"]
