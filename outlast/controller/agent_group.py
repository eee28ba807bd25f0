"""The worker group over real node agents: ZeroMQ sockets to the head, the agents and the workers.

Workers reach the controller on one ROUTER socket (identity "attempt:rank"); each node
agent this run uses gets a DEALER link; the head answers node-table queries on another.
This module only moves bytes: decoding, sending, and noticing (outlast/client/liveness.py) a
node whose agent process is gone from this machine, at once rather than after its silence.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import msgspec
import zmq

from outlast.client.liveness import agent_gone, mark_gone_dead
from outlast.controller import group as g
from outlast.controller.store_table import StoreTable
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.trace import mark
from outlast.protocol.transport import (
    AGENT_EVENTS, HEADER, WORKER_MESSAGES, BadMessage, bind_router, connect_dealer, encode, incarnation_of,
    receive_all, send_or_drop, watch_identity, worker_identity,
)

log = logging.getLogger("outlast.controller")

QUERY_RETRY_S = 3.0  # a table query the head never answered (it may be gone) is sent again after this


def _refused(frames: list[bytes], e: BadMessage) -> g.RefusedFromWorker | None:
    """What a rank (its socket's identity, "attempt:rank[:watch]") sent that did not decode; None from a
    sender that is no rank."""
    try:
        attempt, rank = (int(part) for part in frames[0].decode().split(":")[:2])
    except (UnicodeDecodeError, ValueError):
        return None
    try:  # its type, for the error: the tag is readable even where a field is not
        kind = msgspec.msgpack.decode(frames[-1][len(HEADER):]).get("type", "message")
    except (msgspec.DecodeError, AttributeError):
        kind = "message"
    return g.RefusedFromWorker(attempt, rank, f"the controller refused its {str(kind)[:64]}: {e}")


class AgentGroup:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], head_address: str, key: ClusterKey | None,
                 bind_host: str = "127.0.0.1",
                 clock: Callable[[], float] = time.monotonic,
                 output: Callable[[m.WorkerOutput], None] | None = None) -> None:
        self.ctx = ctx
        self.key = key
        self.head_address = head_address
        self.clock = clock
        self._output = output  # workers' output lines go there, not to the core: they decide nothing
        self.sock, self.address = bind_router(ctx, bind_host, key=key)
        # A rank's identity ("attempt:rank") belongs to its newest process. A live recovery's replacement may
        # connect before the router has seen the lost process's connection end (its node is known lost before its
        # sockets close): without the handover the router keeps the old one's, and never delivers the new one's.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._query = connect_dealer(ctx, head_address, key=key)
        self._query_sent: float | None = None
        self._table: list[m.NodeInfo] = []  # the last table the head (or the store) gave
        self._store = StoreTable.from_env(key)  # a cluster in etcd: the table from a watch, not from a head
        self._addresses: dict[str, str] = {}  # node id -> its agent's address, from the last table
        self._links: dict[str, zmq.Socket[bytes]] = {}
        self._linked_to: dict[str, str] = {}  # node id -> the address its link was made to
        self._gone_told: set[tuple[str, int]] = set()  # (node id, agent pid) already reported gone
        self._poller = zmq.Poller()
        self._wake_fds: set[int] = set()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._query, zmq.POLLIN)

    def refresh(self, timeout_s: float) -> list[m.NodeInfo] | None:
        """Read the node table now (before the run starts); None if the head did not answer."""
        if self._store is not None:
            nodes = self._store.nodes(timeout_s)
            return None if nodes is None else self._take_table(nodes)
        start = self.clock()
        self._send_query(start)
        while (left := timeout_s - (self.clock() - start)) > 0 and self._query.poll(int(left * 1000)):
            for event in self._table_answers():
                return event.nodes
        return None

    # ---- effects out --------------------------------------------------------------------

    def perform(self, effect: g.Effect) -> None:
        if isinstance(effect, g.ToRank):
            to = watch_identity if effect.watch else worker_identity
            self.sock.send_multipart([to(effect.attempt, effect.rank, effect.incarnation), encode(effect.msg)])
        elif isinstance(effect, (g.Spawn, g.StopRun, g.ToNode)):
            if not isinstance(effect, g.ToNode):
                mark("controller." + type(effect).__name__.lower(), node=effect.node_id, attempt=effect.msg.attempt)
            self._send(effect.node_id, effect.msg)
        elif isinstance(effect, g.QueryTable) and self._store is not None:
            self._store.want()
        elif isinstance(effect, g.QueryTable):
            now = self.clock()
            if self._query_sent is None or now - self._query_sent > QUERY_RETRY_S:
                self._send_query(now)
        elif isinstance(effect, g.ForgetNode):
            self._unlink(effect.node_id)

    def _unlink(self, node_id: str) -> None:
        link = self._links.pop(node_id, None)
        self._linked_to.pop(node_id, None)
        if link is not None:
            self._poller.unregister(link)
            link.close(linger=0)

    def _send(self, node_id: str, msg: m.Msg) -> None:
        address = self._addresses.get(node_id)
        if address is not None and self._linked_to.get(node_id, address) != address:
            self._unlink(node_id)  # its agent was started again at another address: the old link leads nowhere
        link = self._links.get(node_id)
        if link is None:
            if address is None:
                log.warning("no address known for node %s; dropped a %s for it", node_id, type(msg).__name__)
                return
            link = self._links[node_id] = connect_dealer(self.ctx, address, key=self.key)
            self._linked_to[node_id] = address
            self._poller.register(link, zmq.POLLIN)
        send_or_drop(link, msg)  # a node that went away must not block the controller once its queue is full

    def _send_query(self, now: float) -> None:
        mark("controller.query")
        if send_or_drop(self._query, m.ListNodes()):  # else sent again on a later turn
            self._query_sent = now

    # ---- events in ----------------------------------------------------------------------

    def also_wake_on(self, fd: int) -> None:
        """`events` returns early when `fd` is readable (the storage executor's answers); the caller reads it."""
        self._wake_fds.add(fd)
        self._poller.register(fd, zmq.POLLIN)

    def events(self, timeout_s: float) -> list[g.InEvent]:
        out: list[g.InEvent] = []
        for sock, _ in self._poller.poll(timeout=int(timeout_s * 1000)):
            if isinstance(sock, int) and sock in self._wake_fds:
                continue
            if sock is self.sock:
                out += self._worker_messages()
            elif sock is self._query:
                out += self._table_answers()
            else:
                out += self._agent_events(sock)
        if self._store is not None:
            for event in self._store.poll():
                if isinstance(event, g.NodeTable):
                    event = g.NodeTable(self._take_table(event.nodes))
                out.append(event)
        for node in self._table:
            if (node.node_id, node.agent_pid) not in self._gone_told and (why := agent_gone(node)):
                self._gone_told.add((node.node_id, node.agent_pid))
                mark("controller.agent_gone", node=node.node_id)
                out.append(g.AgentGone(node.node_id, why))
        return out

    def _worker_messages(self) -> list[g.InEvent]:
        out: list[g.InEvent] = []

        def refuse(frames: list[bytes], e: BadMessage) -> bool:
            refused = _refused(frames, e)
            if refused is not None:
                out.append(refused)
            return refused is not None

        for frames, msg in receive_all(self.sock, WORKER_MESSAGES, "message from a worker", on_bad=refuse):
            out.append(g.FromWorker(msg, incarnation_of(frames[0])))
        return out

    def _agent_events(self, sock: zmq.Socket[bytes]) -> list[g.InEvent]:
        node_id = next((n for n, link in self._links.items() if link is sock), "")
        out: list[g.InEvent] = []
        for _, event in receive_all(sock, AGENT_EVENTS, f"message from node {node_id}"):
            if isinstance(event, m.WorkerOutput):
                if self._output is not None:
                    self._output(event)
            else:
                if isinstance(event, m.WorkerExited):
                    mark("controller.exited", node=node_id, attempt=event.attempt, rank=event.rank)
                out.append(g.FromAgent(node_id, event))
        return out

    def _table_answers(self) -> list[g.NodeTable]:
        out = []
        for _, reply in receive_all(self._query, AGENT_EVENTS, "answer from the head"):
            if isinstance(reply, m.NodeList):
                mark("controller.table")
                self._query_sent = None
                out.append(g.NodeTable(self._take_table(reply.nodes)))
        return out

    def _take_table(self, nodes: list[m.NodeInfo]) -> list[m.NodeInfo]:
        # A node whose agent is gone from this machine is never shown alive.
        self._table = [mark_gone_dead(n) for n in nodes]
        self._addresses.update({n.node_id: n.address for n in self._table})
        return list(self._table)

    def close(self, linger_ms: int = 0) -> None:
        for link in self._links.values():
            link.close(linger=linger_ms)
        self._links.clear()
        self._linked_to.clear()
        if self._store is not None:
            self._store.close()
        self._query.close(linger=0)
        self.sock.close(linger=0)


