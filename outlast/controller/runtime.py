"""The controller loop: events from the worker group and storage into the core, the core's effects back out.

All decisions are in `core.py` (`ControllerCore.step(event, now) -> effects`); all I/O is
in the worker group (`agent_group.py` over real agents, the simulator's in `outlast/sim/`)
and in the storage executor (`executor.py`, on a thread of its own: the loop never waits on
storage). This loop only reads the clocks, keeps the driver lease, and turns Ctrl+C into an event.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Any, Callable, Protocol

from outlast.controller import effects as fx
from outlast.controller import live_steps
from outlast.controller.core import ControllerCore
from outlast.controller.executor import StorageExecutor
from outlast.controller.tier_executor import TierExecutor
from outlast.controller.group import (
    Effect, FromWorker, InEvent, Interrupted, LeaseLost, LiveJoined, LiveReady, NodeTable, PublishMembership, Started, Tick,
    ToRank, WorkerGroup,
)
from outlast.controller.types import RunPlan, Timeouts
from outlast.errors import TrainingFailedError
from outlast.protocol import messages as m
from outlast.trace import mark

__all__ = ["Controller", "RunPlan", "Timeouts"]

log = logging.getLogger("outlast.controller")

POLL_S = 0.1


class LiveStoreIO(Protocol):
    """The store the controller holds for live recovery's groups (`outlast/train/live/store_host.py`)."""

    address: str  # "host:port", as the ranks reach it

    def publish(self, attempt: int, membership_json: str) -> None: ...

    def joined(self, attempt: int, generation: int) -> LiveJoined | None: ...

    def ready(self, attempt: int, member: str) -> LiveReady | None: ...


class StepWatcher(Protocol):
    def observe(self, event: Any, effects: list[Effect | fx.StorageEffect | fx.TierAsk], core: ControllerCore,
                start: float, end: float) -> None: ...


class Controller:
    def __init__(self, plan: RunPlan, group: WorkerGroup, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, watchers: list[StepWatcher] | None = None,
                 storage: StorageExecutor | None = None, live: LiveStoreIO | None = None) -> None:
        self.plan = plan
        self.watchers = watchers or []  # metrics, progress lines: shown each step, deciding nothing
        self.group = group
        self.clock = clock
        self.live = live  # FailureConfig(live_recovery=True): its ranks' store, held here
        if live is not None:
            plan = self.plan = dataclasses.replace(plan, live_store=live.address)
        self.core = ControllerCore(plan, uuid.uuid4().hex[:12], group.address, wall)
        self.storage = storage if storage is not None else StorageExecutor(plan.book.store)
        ctx = getattr(group, "ctx", None)
        # The nodes' memory tiers, over the cluster's transport (a simulated group's nodes have none).
        self.tiers = TierExecutor(ctx, getattr(group, "key", None)) if ctx is not None else None
        wake_on = getattr(group, "also_wake_on", None)
        if wake_on is not None:
            wake_on(self.storage.wake_fd)
            if self.tiers is not None:
                wake_on(self.tiers.wake_fd)

    def run(self) -> None:
        """Drive the run to a terminal state; raise `TrainingFailedError` if it errored."""
        lease = self.plan.lease
        stop_renewing = lease.renew_in_background() if lease is not None else None  # off the loop, as storage is
        try:
            self._run()
        finally:
            if stop_renewing is not None:
                stop_renewing()
            self.storage.close(timeout_s=0 if not self.core.closed else None)
            if self.tiers is not None:
                self.tiers.close()

    def _run(self) -> None:
        nodes = self.group.refresh(timeout_s=10.0)
        if nodes is None:
            raise TrainingFailedError(f"the head at {getattr(self.group, 'head_address', '?')} did not answer", [])
        self._step(NodeTable(nodes))
        self._step(Started())
        interrupted = False
        while not self.core.closed:
            try:
                answers = self.tiers.take() if self.tiers is not None else []
                events = self.group.events(POLL_S) + self.storage.take() + answers or [Tick()]
                # The ranks' word in the live store, written before any of these events happened (a rank's death
                # right after its group formed), goes first: the store answers what was set before it is asked.
                self._live_joined()
                for event in events:
                    self._step(event)
                self._live_joined()
                if self.live is not None:
                    for attempt, member in live_steps.starting(self.core):
                        if (ready := self.live.ready(attempt, member)) is not None:
                            self._step(ready)
                lease = self.plan.lease
                if lease is not None and not self.core.state.kind.is_terminal and (lost := lease.lost):
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

    def _live_joined(self) -> None:
        """Step the word of the live group formed or recovered that the core waits for, once it is in the store (the
        words of the recovery's earlier generations first: what their senders threw away counts)."""
        if self.live is None:
            return
        for attempt, generation in live_steps.unread(self.core):
            if (earlier := self.live.joined(attempt, generation)) is not None:
                self._step(earlier)
        if (awaited := live_steps.awaited(self.core)) is not None \
                and (joined := self.live.joined(*awaited)) is not None:
            self._step(joined)

    def _step(self, event: InEvent | fx.StorageEvent | fx.TierAnswered) -> None:
        if isinstance(event, FromWorker) and isinstance(event.msg, m.Report) and event.msg.checkpoint_dir:
            mark("controller.report", rank=event.msg.rank, index=event.msg.index)  # a SYNC report's commit path
        start = self.clock()
        effects = self.core.step(event, start)
        for watcher in self.watchers:
            watcher.observe(event, effects, self.core, start, self.clock())
        for effect in effects:
            if isinstance(effect, fx.STORAGE_EFFECTS):
                self.storage.submit(effect)
            elif isinstance(effect, fx.TierAsk):
                if self.tiers is not None:
                    self.tiers.submit(effect)
            elif isinstance(effect, PublishMembership):
                if self.live is not None:
                    self.live.publish(effect.attempt, effect.membership)
            else:
                if isinstance(effect, ToRank) and isinstance(effect.msg, m.Committed):
                    mark("controller.committed", rank=effect.rank, index=effect.msg.index)
                self.group.perform(effect)
