"""The controller loop: events from the worker group into the core, the core's effects back out.

All decisions are in `core.py` (`ControllerCore.step(event, now) -> effects`); all I/O is
in the worker group (`agent_group.py` over real agents, the simulator's in `outlast/sim/`).
This loop only reads the clocks, keeps the driver lease, and turns Ctrl+C into an event.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Callable, Protocol

from outlast.controller.core import ControllerCore
from outlast.controller.group import Interrupted, LeaseLost, NodeTable, Started, Tick, WorkerGroup
from outlast.controller.types import RunPlan, Timeouts
from outlast.errors import TrainingFailedError

__all__ = ["Controller", "RunPlan", "Timeouts"]

log = logging.getLogger("outlast.controller")

POLL_S = 0.1


class Watcher(Protocol):
    def observe(self, event, effects: list, core: ControllerCore, start: float, end: float) -> None: ...


class Controller:
    def __init__(self, plan: RunPlan, group: WorkerGroup, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, watchers: list[Watcher] | None = None) -> None:
        self.plan = plan
        self.watchers = watchers or []  # metrics, progress lines: shown each step, deciding nothing
        self.group = group
        self.clock = clock
        self.core = ControllerCore(plan, uuid.uuid4().hex[:12], group.address, wall)

    def run(self) -> None:
        """Drive the run to a terminal state; raise `TrainingFailedError` if it errored."""
        nodes = self.group.refresh(timeout_s=10.0)
        if nodes is None:
            raise TrainingFailedError(f"the head at {getattr(self.group, 'head_address', '?')} did not answer", [])
        self._step(NodeTable(nodes))
        self._step(Started())
        interrupted = False
        while not self.core.closed:
            try:
                for event in self.group.events(POLL_S) or [Tick()]:
                    self._step(event)
                lease = self.plan.lease
                if lease is not None and not self.core.state.kind.is_terminal \
                        and (lost := lease.renew_if_due(self.clock())):
                    self._step(LeaseLost(lost))
            except KeyboardInterrupt:
                if interrupted:
                    raise
                interrupted = True  # tear down through the same loop; a second Ctrl+C stops waiting
                self._step(Interrupted())
        if interrupted:
            raise KeyboardInterrupt
        if self.core.error is not None:
            raise self.core.error

    def _step(self, event) -> None:
        start = self.clock()
        effects = self.core.step(event, start)
        for watcher in self.watchers:
            watcher.observe(event, effects, self.core, start, self.clock())
        for effect in effects:
            self.group.perform(effect)
