"""The controller's view of the cluster: the head's node table, drains heard of, lost nodes.

Every agent that runs a worker of this run gets the run's heartbeats (it kills the
run's workers when they stop) and answers them; a node whose answers stop for
`node_timeout_s` is lost, whatever the head says, and so is one the head declares dead.
Pure: the table and what nodes say come in as calls, with the time.
"""

from __future__ import annotations

import msgspec

from outlast.controller.placement import NodeView
from outlast.protocol import messages as m

LOST_NODE_QUARANTINE_S = 30.0
STALL_S = 0.5  # a gap between ticks longer than this was the controller's own stall


class NodeBook:
    def __init__(self, node_timeout_s: float = 5.0) -> None:
        self.node_timeout_s = node_timeout_s
        self.nodes: dict[str, m.NodeInfo] = {}
        self.heard: dict[str, float] = {}  # linked node -> when its agent last said anything (monotonic)
        self._gone: dict[str, tuple[int, str]] = {}  # node -> (the gone agent's pid, why)
        self._pids: dict[str, int] = {}  # linked node -> its agent's pid, from its answers
        self._last_tick: float | None = None
        # (node id, agent pid) -> when this driver lost it: an agent started again is not that node
        self._lost_here: dict[tuple[str, int], float] = {}
        self._drained_here: dict[str, m.NodeDraining] = {}  # drains this driver heard of from the nodes
        self._drains: dict[str, m.NodeDraining] = {}  # every drain seen, kept after the node is gone
        self.head: m.NodeInfo | None = None  # the head, as the last table named it (none: a cluster in etcd)
        self.table_at: float | None = None  # when the last table came (monotonic)

    # ---- the node table -----------------------------------------------------------------

    def set_table(self, nodes: list[m.NodeInfo], now: float | None = None) -> None:
        """The head's table (`now`: when it came; a table set by hand leaves the head's silence as it was)."""
        self.nodes = {n.node_id: n for n in nodes}
        if now is not None:
            self.table_at = now
            self.head = next((n for n in nodes if n.is_head), self.head)
        for n in nodes:
            if n.node_id not in self.heard:  # this run has let the old agent go
                self._forget_gone_agent(n.node_id, n.agent_pid)
            if n.draining is not None:
                self._drains.setdefault(n.node_id, n.draining)
            elif n.state == "alive":  # back after a death: a new start
                self._drains.pop(n.node_id, None)
        self._overlay_drains()

    def note_draining(self, notice: m.NodeDraining) -> None:
        """A node told this driver it is draining: no new work there, even before the head's table says so
        (a node drains itself on SIGTERM and tells the head with its next heartbeat)."""
        for node_id in set(notice.node_ids) | {notice.node_id}:
            self._drained_here[node_id] = notice
            self._drains.setdefault(node_id, notice)
        self._overlay_drains()

    def drain_of(self, node_id: str) -> m.NodeDraining | None:
        """The drain notice of a node, if it was ever drained (and has not come back since)."""
        return self._drains.get(node_id)

    def _overlay_drains(self) -> None:
        for node_id, notice in list(self._drained_here.items()):
            node = self.nodes.get(node_id)
            if node is None:
                continue
            if node.state == "dead":  # a node that comes back later is a new start, not draining
                del self._drained_here[node_id]
            elif node.state == "alive":
                self.nodes[node_id] = msgspec.structs.replace(node, state="draining", draining=notice)

    def views(self, run_id: str, now: float) -> list[NodeView]:
        """What each live node can give this run: its resources minus what other runs hold there."""
        out = []
        for n in self.nodes.values():
            # A node this driver lost may look alive to the head (a partition between the two):
            # it gets no work until it has been out of sight for a while.
            lost_at = self._lost_here.get((n.node_id, n.agent_pid), float("-inf"))
            gone = self._gone.get(n.node_id)
            if n.state == "dead" or now - lost_at < LOST_NODE_QUARANTINE_S or (gone and gone[0] in (0, n.agent_pid)):
                continue  # ... and a node whose agent is known gone, unless the table shows one started since
            free = dict(n.resources)
            for other, held in n.used.items():
                if other != run_id:
                    for k, v in held.items():
                        free[k] = free.get(k, 0.0) - v
            out.append(NodeView(node_id=n.node_id, address=n.address, resources=free,
                                draining=n.state == "draining"))
        return out

    def describe(self) -> str:
        # A node whose agent is known gone is dead, even in the last table a dead head sent.
        states = [f"{n.node_id} ({'dead' if n.node_id in self._gone else n.state})" for n in self.nodes.values()]
        return ", ".join(states) or "no nodes"

    # ---- nodes this run talks to --------------------------------------------------------

    def link(self, node_id: str, now: float) -> bool:
        """Start hearing from a node; True if it is new to this run (it gets the run's heartbeat first)."""
        info = self.nodes.get(node_id)
        linked_pid = self._pids.get(node_id, 0)
        # New ranks go to the agent there now: if it was started since, it is not the one gone.
        self._forget_gone_agent(node_id, linked_pid)
        self._forget_gone_agent(node_id, info.agent_pid if info else 0)
        if info is not None and info.agent_pid:  # the agent placed on (the spawn names it: another refuses)
            self._pids[node_id] = info.agent_pid
        # An agent started since this run last heard the node (while none of its ranks were there) has
        # said nothing to this run yet: its silence begins now, not when the old one last answered.
        started_since = bool(info is not None and info.agent_pid and linked_pid and linked_pid != info.agent_pid)
        if node_id in self.heard and not started_since:
            return False
        self.heard[node_id] = now
        return True

    def note_heard(self, node_id: str, now: float) -> None:
        if node_id in self.heard:
            self.heard[node_id] = now

    def note_gone(self, node_id: str, why: str) -> None:
        info = self.nodes.get(node_id)
        self._gone[node_id] = (info.agent_pid if info else 0, why)

    def _forget_gone_agent(self, node_id: str, agent_pid: int) -> None:
        """The node's agent is `agent_pid` now: if it was started again since its agent was gone, the node
        is usable again (a lost node is kept out by (node id, agent pid), not by its id)."""
        gone = self._gone.get(node_id)
        if gone is not None and gone[0] and agent_pid and gone[0] != agent_pid:
            del self._gone[node_id]
            self._pids.pop(node_id, None)  # the gone agent's: the new one's answers start afresh

    def note_pid(self, node_id: str, pid: int) -> None:
        """A linked node's agent answered with its pid: another pid than before is a new agent, and the
        workers the old one ran are gone (a persistent agent started again within the node timeout)."""
        if node_id not in self.heard or not pid:
            return
        old = self._pids.setdefault(node_id, pid)
        self._pids[node_id] = pid
        if old != pid and node_id not in self._gone:
            self._gone[node_id] = (old, f"the node agent of node {node_id} was started again (pid {old}, now "
                                        f"{pid}): the workers of the old one are gone")

    def note_tick(self, now: float) -> None:
        """While the controller itself was busy, no node was heard: that time is not their silence."""
        if self._last_tick is not None and (stalled := now - self._last_tick) > STALL_S:
            for node_id in self.heard:
                self.heard[node_id] += stalled
            if self.table_at is not None:
                self.table_at += stalled
        self._last_tick = now

    def lose(self, node_id: str, now: float) -> None:
        """This driver lost the node: no messages to it, and no work for a while."""
        info, gone = self.nodes.get(node_id), self._gone.get(node_id)
        pid = gone[0] if gone is not None and gone[0] else info.agent_pid if info else 0
        self._lost_here[(node_id, pid)] = now
        self.heard.pop(node_id, None)
        self._pids.pop(node_id, None)

    def reachable(self, node_id: str) -> bool:
        """Whether the node's agent, as the table has it now, is one this driver has not lost: what it
        keeps (its memory tier's copies) can still be asked for. An agent started again is reachable."""
        info = self.nodes.get(node_id)
        return info is not None and info.state != "dead" and node_id not in self._gone \
            and (node_id, info.agent_pid) not in self._lost_here

    def tier_of(self, node_id: str) -> str:
        """The node's memory tier, while this driver can reach the node: none of a node that is gone (dead in the
        table, its agent gone from this machine, or lost by this driver), whose copies and answers are gone with it."""
        node = self.nodes.get(node_id)
        return node.tier_address if node is not None and self.reachable(node_id) else ""

    def head_lost(self, now: float) -> str | None:
        """Why the head is gone, or None: it has answered no table query for longer than `node_timeout_s`, the
        silence after which it declares any node dead. A head started again within it answers, and is not lost.
        A cluster in etcd has no one head: its tables come from the driver's own watch, whatever dies."""
        if self.head is None or self.table_at is None or now - self.table_at <= self.node_timeout_s:
            return None
        return (f"the head node {self.head.node_id} ({self.head.address}) has answered no node-table query for "
                f"{now - self.table_at:.0f} s (OUTLAST_NODE_TIMEOUT_S={self.node_timeout_s:g}): it is gone, and "
                "without it no node joins or is declared dead, and no drain reaches the run")

    def lost_nodes(self, now: float, nodes: set[str]) -> dict[str, str]:
        """Of `nodes`, those lost now, with why."""
        out = {}
        for node_id in sorted(nodes):
            info, heard = self.nodes.get(node_id), self.heard.get(node_id)
            address = info.address if info is not None else "?"
            if node_id in self._gone:  # why its agent is gone says more than the head's "dead", which may follow it
                out[node_id] = self._gone[node_id][1]
            elif info is not None and info.state == "dead":
                out[node_id] = f"the head declared node {node_id} ({address}) dead"
            elif heard is not None and now - heard > self.node_timeout_s:
                out[node_id] = f"node {node_id} ({address}) stopped answering (silent for {now - heard:.1f} s)"
        return out
