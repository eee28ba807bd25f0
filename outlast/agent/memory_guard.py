"""The agent's side of resource isolation: its worker table seen by the kill policy, kills done.

`NodeIsolation` knows cgroups and the policy; this module knows the agent's workers and
runs, turns them into candidates, and kills the victims (whole leaves) it is given.
"""

from __future__ import annotations

import logging
import signal

from outlast.procutil import kill_tree
from outlast.isolation.config import IsolationConfig
from outlast.isolation.monitor import EventSource
from outlast.isolation.node import NodeIsolation
from outlast.isolation.policy import Action, Candidate, render_report
from outlast.protocol import messages as m

log = logging.getLogger("outlast.agent")

THRESHOLD_INTERVAL_S = 0.25  # the threshold monitor: shared memory charged outside user/ sends no event


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
            self.iso.remove_leaf(leaf)

    # ---- monitors --------------------------------------------------------------------------

    def sources_by_fd(self) -> dict[int, EventSource]:
        return {s.fd: s for s in self.iso.sources}

    def on_event(self, source: EventSource, agent) -> None:
        self.check(agent, self.iso.drain(source))

    def on_tick(self, now: float, agent) -> None:
        self.iso.tidy()
        if now >= self._next_sample:
            self._next_sample = now + THRESHOLD_INTERVAL_S
            self.check(agent, "threshold monitor (anon + shared memory)")

    def check(self, agent, trigger: str) -> None:
        candidates = self.candidates(agent)
        decision = self.iso.check(candidates, set(agent.workers), trigger)
        if decision.action is not Action.KILL:
            return
        for victim in decision.victims:
            w = agent.workers.get(victim.pid)
            if w is None:
                continue
            w.kill_report = decision.report
            if w.leaf:
                self.iso.kill_leaf(w.leaf)
            kill_tree(w.pid, signal.SIGKILL)
            w.kill_at = float("inf")

    def candidates(self, agent) -> list[Candidate]:
        out = []
        for w in agent.workers.values():
            if w.leaf is None or w.kill_report is not None:
                continue
            run = agent.runs.get(w.run_id)
            idle = w.kill_at is not None or run is None or run.ended
            out.append(Candidate(
                name=w.leaf, kind="task" if w.task_id else "training", owner=w.task_id or w.run_id,
                rank=None if w.task_id else w.rank, pid=w.pid, memory_bytes=self.iso.leaf_memory(w.leaf),
                started_at=w.started_at, resources=w.resources, idle=idle, retriable=w.retriable,
                run_world_size=w.world_size, last_commit_at=run.last_commit_at if run else None,
            ))
        return out

    # ---- status and stop -----------------------------------------------------------------------

    def render(self, report: m.KillReport) -> str:
        return render_report(report)

    def info(self) -> m.IsolationInfo:
        return self.iso.info()

    def recent_kills(self) -> list[m.KillReport]:
        return list(self.iso.recent)

    def capacity(self) -> m.Resources:
        return self.iso.capacity()

    def close(self) -> None:
        self.iso.close()


