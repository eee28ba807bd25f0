"""The controller's connections to the cluster: the head's node table and one link per node.

Every agent that runs a worker of this run gets the run's heartbeats (it kills the
run's workers when they stop) and answers them; a node whose answers stop for
`node_timeout_s` is lost, whatever the head says, and so is one the head declares dead.
"""

from __future__ import annotations

import logging
from typing import Callable

import msgspec
import zmq

from outlast.client.liveness import agent_gone, mark_gone_dead
from outlast.controller.placement import NodeView
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.protocol.transport import AGENT_EVENTS, BadMessage, connect_dealer, encode

log = logging.getLogger("outlast.controller")

LOST_NODE_QUARANTINE_S = 30.0


class AgentLink:
    """The controller's connection to one node agent (a DEALER socket)."""

    def __init__(self, sock: zmq.Socket, address: str, alive: Callable[[], bool] = lambda: True) -> None:
        self.sock = sock
        self.address = address
        self.alive = alive
        self.last_reply = 0.0  # monotonic

    def send(self, msg: m.Msg) -> None:
        # A node that went away must not block the controller once its queue is full.
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass


class Cluster:
    """The head's node table as last read, and the links to the nodes this run uses."""

    def __init__(self, ctx: zmq.Context, head_address: str, key: ClusterKey | None, clock,
                 head_alive: Callable[[], bool] = lambda: True, node_timeout_s: float = 5.0) -> None:
        self.ctx = ctx
        self.key = key
        self.clock = clock
        self.head_address = head_address
        self.node_timeout_s = node_timeout_s
        self._head_alive = head_alive
        self.nodes: dict[str, m.NodeInfo] = {}
        self.links: dict[str, AgentLink] = {}
        self._query = connect_dealer(ctx, head_address, key=key)
        self._query_sent: float | None = None  # when the unanswered query went out
        self._next_query = 0.0
        self._last_tick = clock()
        # (node id, agent pid) -> when this driver lost it: an agent started again is not that node
        self._lost_here: dict[tuple[str, int], float] = {}
        self._drained_here: dict[str, m.NodeDraining] = {}  # drains this driver heard of from the nodes

    # ---- the node table -----------------------------------------------------------------

    def refresh(self, timeout_s: float) -> bool:
        """Read the node table now (before placing an attempt); False if the head did not answer,
        and the table stays as last read."""
        start = self.clock()
        self._send_query(start)
        while (left := timeout_s - (self.clock() - start)) > 0 and self._query.poll(int(left * 1000)):
            if self._take_answers():
                return True
        return False

    def poll_table(self, now: float, interval_s: float = 1.0) -> None:
        """Keep the table fresh in the background: drains and deaths the head saw."""
        self._take_answers()
        # A query the head never answered (it may be gone) is sent again after a while.
        if now >= self._next_query and (self._query_sent is None or now - self._query_sent > 3.0):
            self._send_query(now)
            self._next_query = now + interval_s

    def _send_query(self, now: float) -> None:
        try:
            self._query.send(encode(m.ListNodes()), zmq.NOBLOCK)
            self._query_sent = now
        except zmq.Again:
            pass

    def note_tick(self, now: float) -> None:
        """While the controller itself was busy, no node was heard: that time is not their silence."""
        stalled = now - self._last_tick
        if stalled > 0.5:
            for link in self.links.values():
                link.last_reply += stalled
        self._last_tick = now

    def _take_answers(self) -> bool:
        answered = False
        while True:
            try:
                data = self._query.recv(zmq.NOBLOCK)
            except zmq.Again:
                return answered
            try:
                reply = AGENT_EVENTS.decode(data)
            except BadMessage as e:
                log.warning("dropped a malformed answer from the head: %s", e)
                continue
            if isinstance(reply, m.NodeList):
                self._query_sent, answered = None, True
                self.nodes = {n.node_id: mark_gone_dead(n) for n in reply.nodes}
                self._overlay_drains()

    def note_draining(self, notice: m.NodeDraining) -> None:
        """A node told this driver it is draining: no new work there, even before the head's table says so
        (a node drains itself on SIGTERM and tells the head with its next heartbeat)."""
        for node_id in set(notice.node_ids) | {notice.node_id}:
            self._drained_here[node_id] = notice
        self._overlay_drains()

    def _overlay_drains(self) -> None:
        for node_id, notice in list(self._drained_here.items()):
            node = self.nodes.get(node_id)
            if node is None:
                continue
            if node.state == "dead":  # a node that comes back later is a new start, not draining
                del self._drained_here[node_id]
            elif node.state == "alive":
                self.nodes[node_id] = msgspec.structs.replace(node, state="draining", draining=notice)

    def views(self, run_id: str) -> list[NodeView]:
        """What each live node can give this run: its resources minus what other runs hold there."""
        out = []
        now = self.clock()
        for n in self.nodes.values():
            # A node this driver lost may look alive to the head (a partition between the two):
            # it gets no work until it has been out of sight for a while.
            lost_at = self._lost_here.get((n.node_id, n.agent_pid), float("-inf"))
            if n.state == "dead" or now - lost_at < LOST_NODE_QUARANTINE_S:
                continue
            free = dict(n.resources)
            for other, held in n.used.items():
                if other != run_id:
                    for k, v in held.items():
                        free[k] = free.get(k, 0.0) - v
            out.append(NodeView(node_id=n.node_id, address=n.address, resources=free,
                                draining=n.state == "draining"))
        return out

    def describe(self) -> str:
        states = [f"{n.node_id} ({mark_gone_dead(n).state})" for n in self.nodes.values()]  # a dead head's last table
        return ", ".join(states) or "no nodes"

    # ---- links to agents ----------------------------------------------------------------

    def link(self, node_id: str) -> AgentLink:
        link = self.links.get(node_id)
        if link is None:
            address = self.nodes[node_id].address
            alive = self._head_alive if address == self.head_address else (lambda: True)
            link = self.links[node_id] = AgentLink(connect_dealer(self.ctx, address, key=self.key), address, alive)
            link.last_reply = self.clock()
        return link

    def head_link(self) -> AgentLink:
        """The head as an agent (before the table is known: a cluster of one node starts here)."""
        for node_id, n in self.nodes.items():
            if n.address == self.head_address:
                return self.link(node_id)
        raise KeyError("the head is not in its own node table")

    def lose(self, node_id: str) -> None:
        """This driver lost the node: close its link and give it no work for a while."""
        info = self.nodes.get(node_id)
        self._lost_here[(node_id, info.agent_pid if info else 0)] = self.clock()
        link = self.links.pop(node_id, None)
        if link is not None:
            link.sock.close(linger=0)

    def lost_nodes(self, now: float, nodes: set[str]) -> dict[str, str]:
        """Of `nodes`, those lost now, with why."""
        out = {}
        for node_id in nodes:
            info, link = self.nodes.get(node_id), self.links.get(node_id)
            if info is not None and (gone := agent_gone(info)):
                out[node_id] = gone
            elif info is not None and info.state == "dead":
                out[node_id] = f"the head declared node {node_id} ({info.address}) dead"
            elif link is not None and not link.alive():
                out[node_id] = f"the node agent at {link.address} exited"
            elif link is not None and now - link.last_reply > self.node_timeout_s:
                out[node_id] = (f"node {node_id} ({link.address}) stopped answering "
                                f"(silent for {now - link.last_reply:.1f} s)")
        return out

    def close(self, linger_ms: int) -> None:
        for link in self.links.values():
            link.sock.close(linger=linger_ms)
        self.links.clear()
        self._query.close(linger=0)
