"""The agent's side of resource isolation: a snapshot of its workloads judged by the kill policy.

`NodeIsolation` knows cgroups and the policy; this module turns the supervisor's view of
the workloads into candidates, kills the victims' leaves, and names the victims.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from outlast.agent.supervisor import WorkloadView
from outlast.isolation.config import IsolationConfig
from outlast.isolation.monitor import EventSource
from outlast.isolation.node import NodeIsolation
from outlast.isolation.policy import Action, KillCandidate
from outlast.protocol import messages as m

log = logging.getLogger("outlast.agent")

# A SIGKILLed process leaves its cgroup within milliseconds unless the kernel holds it (D state).
LEAF_EMPTY_WAIT_S = 1.0
THRESHOLD_INTERVAL_S = 0.25  # the threshold monitor: shared memory charged outside user/ sends no event


@dataclass(frozen=True)
class Victim:
    pid: int
    report: m.KillReport


class MemoryGuard:
    def __init__(self, iso: NodeIsolation) -> None:
        self.iso = iso
        self._next_sample = 0.0

    @classmethod
    def start(cls, config: IsolationConfig, node_id: str) -> MemoryGuard:
        return cls(NodeIsolation.start(config, node_id))

    # ---- leaves ---------------------------------------------------------------------------

    def create_leaf(self, name: str, resources: m.Resources) -> list[str]:
        return self.iso.create_leaf(name, resources)

    def kill_leaf(self, name: str) -> None:
        self.iso.kill_leaf(name)

    def leaf_memory(self, name: str) -> int:
        return self.iso.leaf_memory(name)

    def on_reaped(self, pid: int, leaf: str | None) -> None:
        self.iso.note_reaped(pid)
        if leaf:
            self.iso.kill_leaf(leaf)  # what the worker started and left behind goes with it
            # The exit is reported after this: the run's fit() may return on it, and nothing the worker
            # started may outlive that (nor may its empty leaf).
            deadline = time.monotonic() + LEAF_EMPTY_WAIT_S
            while self.iso.leaf_pids(leaf) and time.monotonic() < deadline:
                time.sleep(0.002)
            self.iso.remove_leaf(leaf)

    # ---- monitors --------------------------------------------------------------------------

    def sources_by_fd(self) -> dict[int, EventSource]:
        return {s.fd: s for s in self.iso.sources}

    def on_event(self, source: EventSource, view: list[WorkloadView]) -> list[Victim]:
        return self.check(view, self.iso.take_event(source))

    def on_tick(self, now: float, view: list[WorkloadView]) -> list[Victim]:
        self.iso.tidy()
        if now < self._next_sample:
            return []
        self._next_sample = now + THRESHOLD_INTERVAL_S
        return self.check(view, "threshold monitor (anon + shared memory)")

    def check(self, view: list[WorkloadView], trigger: str) -> list[Victim]:
        """Whom to kill for memory, judged on a snapshot of the workloads. The victims' leaves are
        killed here (a worker's children too); the caller kills the workloads and keeps the report."""
        decision = self.iso.check(self.candidates(view), {w.pid for w in view}, trigger)
        if decision.action is not Action.KILL:
            return []
        report = decision.report
        assert report is not None  # a kill always carries its report (isolation/policy.py)
        leaves = {w.pid: w.leaf for w in view}
        victims = []
        for victim in decision.victims:
            if victim.pid not in leaves:
                continue
            leaf = leaves[victim.pid]
            if leaf:
                self.iso.kill_leaf(leaf)
            victims.append(Victim(victim.pid, report))
        return victims

    def candidates(self, view: list[WorkloadView]) -> list[KillCandidate]:
        return [KillCandidate(
            name=w.leaf, kind=w.kind, owner=w.owner, rank=w.rank, pid=w.pid, memory_bytes=self.iso.leaf_memory(w.leaf),
            started_at=w.started_at, resources=w.resources, idle=w.idle, retriable=w.retriable,
            run_world_size=w.world_size, last_commit_at=w.last_commit_at,
        ) for w in view if w.leaf is not None and not w.already_killed]

    # ---- status and stop -----------------------------------------------------------------------

    def info(self) -> m.IsolationInfo:
        return self.iso.info()

    def recent_kills(self) -> list[m.KillReport]:
        return list(self.iso.recent)

    def capacity(self) -> m.Resources:
        return self.iso.capacity()

    def close(self) -> None:
        self.iso.close()


