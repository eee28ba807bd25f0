"""A worker group in memory: it carries the controller's effects out on scripted workers."""

from __future__ import annotations

from collections import deque
from typing import Callable

from outlast.controller import group as g
from outlast.protocol import messages as m


class FakeWorkerGroup:
    """Workers that say hello, report `reports` times, and return (or do what `on_spawn` says).

    `performed` keeps every effect in order; `clock` is advanced by each `events()` wait, so a
    controller driven by it runs on virtual time.
    """

    address = "fake://controller"

    def __init__(self, nodes: list[m.NodeInfo], reports: int = 2,
                 on_spawn: Callable[["FakeWorkerGroup", m.SpawnWorkers, str], None] | None = None) -> None:
        self.nodes = nodes
        self.reports = reports
        self.on_spawn = on_spawn or FakeWorkerGroup.run_to_the_end
        self.now = 0.0
        self.performed: list[g.Effect] = []
        self.inbox: deque[g.InEvent] = deque()
        self.closed = False
        self.interrupt_at_poll: int | None = None
        self._polls = 0

    def clock(self) -> float:
        return self.now

    def refresh(self, timeout_s: float) -> list[m.NodeInfo] | None:
        return list(self.nodes) if self.nodes else None

    def perform(self, effect: g.Effect) -> None:
        self.performed.append(effect)
        if isinstance(effect, g.Spawn):
            self.on_spawn(self, effect.msg, effect.node_id)
        elif isinstance(effect, g.StopRun):
            self.inbox.extend(g.FromAgent(effect.node_id, m.WorkerExited(
                run_id=effect.msg.run_id, attempt=effect.msg.attempt, rank=rank, pid=rank, exit_code=None, signal=15,
                error=None, node_id=effect.node_id)) for rank in self._ranks_on(effect.node_id, effect.msg.attempt))
        elif isinstance(effect, g.QueryTable):
            self.inbox.append(g.NodeTable(list(self.nodes)))

    def events(self, timeout_s: float) -> list[g.InEvent]:
        self._polls += 1
        if self.interrupt_at_poll is not None and self._polls == self.interrupt_at_poll:
            raise KeyboardInterrupt
        self.now += 0.01 if self.inbox else timeout_s
        out = list(self.inbox)
        self.inbox.clear()
        return out

    def close(self) -> None:
        self.closed = True

    # ---- scripted workers -------------------------------------------------------------

    def _ranks_on(self, node_id: str, attempt: int) -> list[int]:
        return [w.rank for e in self.performed if isinstance(e, g.Spawn) and e.node_id == node_id
                and e.msg.attempt == attempt for w in e.msg.workers]

    @staticmethod
    def run_to_the_end(group: "FakeWorkerGroup", spawn: m.SpawnWorkers, node_id: str) -> None:
        a = spawn.attempt
        for w in spawn.workers:
            group.inbox.append(g.FromWorker(m.WorkerHello(attempt=a, rank=w.rank, pid=w.rank)))
            group.inbox.append(g.FromWorker(m.SetUp(attempt=a, rank=w.rank)))
        for i in range(group.reports):
            for w in spawn.workers:
                group.inbox.append(g.FromWorker(m.Report(attempt=a, rank=w.rank, index=i, metrics={"step": i})))
        for w in spawn.workers:
            group.inbox.append(g.FromWorker(m.WorkerDone(attempt=a, rank=w.rank, reports=group.reports)))
            group.inbox.append(g.FromAgent(node_id, m.WorkerExited(run_id=spawn.run_id, attempt=a, rank=w.rank,
                                                                   pid=w.rank, exit_code=0, signal=None, error=None,
                                                                   node_id=node_id)))

    @staticmethod
    def stay_running(group: "FakeWorkerGroup", spawn: m.SpawnWorkers, node_id: str) -> None:
        for w in spawn.workers:
            group.inbox.append(g.FromWorker(m.WorkerHello(attempt=spawn.attempt, rank=w.rank, pid=w.rank)))
            group.inbox.append(g.FromWorker(m.SetUp(attempt=spawn.attempt, rank=w.rank)))
