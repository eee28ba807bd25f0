"""The controller's core: `step(event, now) -> effects`, and nothing else touches the world.

What happened comes in as one event (`group.py`, and storage's answers, `effects.py`); what to
do goes out as effects: messages for agents and ranks, carried out by a worker group, and
storage calls, carried out by an executor off the loop (`executor.py`). The core never calls
storage, so nothing it does waits on it: heartbeats and answers to ranks go on while storage
is slow.

`ControllerCore` is the explicit state and its one entry point. What each event does is a plain
function over that state, found in a table by the event's type: `handlers.py` (agents, a
worker's exit, failures), `on_workers.py` (worker messages, collectives), `checkpoints.py` (the
commit in two phases, retention, what to restore), `lifecycle.py` (placing, restarting,
settling, closing), `hang_steps.py`. Decisions live in `states.py` (the table and the states'
data), `policy.py` and `settle.py` (restart or raise), `placement.py`, `commit.py` (when a
checkpoint is whole), `collectives.py`, `horizons.py` and `preemption.py`. Time comes in as
`now` (monotonic); the wall time for records and deadlines comes from the injected `wall`
clock. Teardown goes through this same path: a run is `closed` once its workers are gone (or
the wait for them is over) and storage has answered every effect.
"""

from __future__ import annotations

import logging
from typing import Callable

from outlast.controller import checkpoints, handlers, hang_steps, lifecycle, memory_holds, on_workers, peer_uploads, resize
from outlast.controller import effects as fx
from outlast.controller import states as st
from outlast.controller.collectives import CollectiveTracker
from outlast.controller.commit import CommitTracker, PendingCheckpoint
from outlast.controller.group import (
    AgentGone, Effect, FromAgent, FromWorker, InEvent, Interrupted, LeaseLost, NodeTable, QueryTable,
    RefusedFromWorker, Started, Tick, ToNode,
)
from outlast.controller.hangs import HangWatch
from outlast.controller.horizons import HorizonBook
from outlast.controller.nodes import NodeBook
from outlast.controller.types import AttemptState, RunPlan
from outlast.controller.upload_estimate import UploadEstimate
from outlast.errors import TrainingFailedError
from outlast.protocol import messages as m
from outlast.storage.records import FailureRecord

log = logging.getLogger("outlast.controller")

TABLE_POLL_S = 1.0
NODE_CHECK_S = 0.1

OnDone = Callable[["ControllerCore", fx.StorageDone], None]


class ControllerCore:
    def __init__(self, plan: RunPlan, run_id: str, address: str, wall: Callable[[], float]) -> None:
        self.plan = plan
        self.run_id = run_id
        self.address = address  # where workers reach the controller
        self.wall = wall
        self.book = plan.book  # the run's history, in memory; written through WriteRunState effects
        self.state: st.AnyState = st.Initializing()
        self.nodes = NodeBook(plan.timeouts.node_lost_after_s)
        self.attempt: AttemptState | None = None
        self.commits = CommitTracker(plan.world_size)
        self.collectives = new_collectives(self)
        self.horizons = HorizonBook()
        self.uploads = UploadEstimate()  # the attempt's checkpoint uploads in flight
        self.resizes = resize.Resizes(plan.elastic)
        self.retention = checkpoints.RetentionRule(plan.num_to_keep, plan.score_attribute, plan.score_order)
        self.hangs: HangWatch | None = None
        self.last_metrics: dict | None = None
        self.failures: list[FailureRecord] = []
        self.error: TrainingFailedError | None = None
        self.closing = False  # the run is over; waiting for storage to answer what it was given
        self.closed = False
        self.storage: dict[int, tuple[fx.StorageEffect, OnDone | None]] = {}  # asked of storage, not yet answered
        self.storage_slow: fx.StorageSlow | None = None  # the call storage has been slow on, while it goes on
        self.committing: dict[int, checkpoints.Committing] = {}  # manifests being written, by effect id
        self.reading_back: dict[str, PendingCheckpoint] = {}  # checkpoints whose stored copies are being read
        self.holds: dict[str, memory_holds.Holding] = {}  # checkpoints whose copies in memory are being made
        self.tier_asks: dict[int, memory_holds.OnTier | None] = {}  # asked of nodes' tiers, not yet answered
        self.freeing: set[int] = set()  # the run's end: nodes asked to free its copies, not yet answered
        self.free_by = 0.0  # when the close stops waiting for them
        self.local_dirs: dict[tuple[int, int, int], str] = {}  # (attempt, report, rank) -> the rank's own directory
        self.tier_said: set[str] = set()  # why a copy was not kept in memory, each said once
        self.rank_files: dict[str, dict[int, list[str]]] = {}  # checkpoint -> rank -> its files' names (memory_holds)
        self.peer_bps: dict[str, float] = {}  # node -> its last replica's rate to its peer
        self.through_peer: set[tuple[int, int]] = set()  # (attempt, report) of notices' checkpoints through a peer
        self.durable: dict[str, peer_uploads.Durable] = {}  # committed through a peer, being uploaded
        # CheckUploads asked, by effect id: (attempt, rank, report index, checkpoint) of an upload whose rank
        # exited before its UploadDone came
        self.checking_uploads: dict[int, tuple[int, int, int, str]] = {}
        self._next_id = 0
        self.written_latest = plan.book.state.latest_checkpoint  # as the last run state handed to storage named it
        self.out: list[Effect | fx.StorageEffect] = []
        self.now = 0.0
        self.next_heartbeat = float("-inf")
        self.next_query = float("-inf")
        self.next_node_check = float("-inf")

    # ---- the one entry point ----------------------------------------------------------

    def step(self, event: InEvent | fx.StorageEvent, now: float) -> list[Effect | fx.StorageEffect]:
        self.now = now
        if isinstance(self.state, st.Placing) and self.state.place_by is None and self.attempt is not None \
                and self.attempt.prepared and not isinstance(event, STORAGE_EVENTS):
            # The wait for a fresh table counts from the first event from outside after the step that asked
            # for it: the loop may have stalled meanwhile, and a table older than the stall is no table to place on.
            self.state = st.Placing(place_by=now + lifecycle.TABLE_WAIT_S)
        if not self.closed:
            handler = EVENTS.get(type(event))
            if handler is not None and (not self.closing or type(event) in STORAGE_EVENTS):
                handler(self, event)
            if not self.closing:
                timers(self, now)
            write_state(self)
            if self.closing and not self.storage and (not self.freeing or now >= self.free_by):
                self.closed = True
        out, self.out = self.out, []
        return out

    # ---- what every handler uses ------------------------------------------------------

    def ask_storage(self, make: Callable[[int], fx.StorageEffect], on_done: OnDone | None = None) -> int:
        """Hand storage an effect (carried out after every earlier one); `on_done` hears its result."""
        self._next_id += 1
        effect = make(self._next_id)
        self.storage[self._next_id] = (effect, on_done)
        self.out.append(effect)
        return self._next_id

    def send_to_rank(self, rank: int, msg: m.Msg, attempt: int | None = None) -> None:
        from outlast.controller.group import ToRank

        number = attempt if attempt is not None else self.attempt.number if self.attempt is not None else None
        assert number is not None
        self.out.append(ToRank(number, rank, msg))


def new_collectives(c: ControllerCore) -> CollectiveTracker:
    return CollectiveTracker(c.plan.world_size, c.plan.timeouts.collective_warn_s, c.plan.timeouts.collective_timeout_s)


def write_state(c: ControllerCore) -> None:
    """The history changed: hand storage the new state (before any effect that relies on it)."""
    data = c.book.take_snapshot()
    if data is not None:
        latest = c.book.state.latest_checkpoint
        names_commit, c.written_latest = latest != c.written_latest, latest
        c.ask_storage(lambda i: fx.WriteRunState(i, data, names_commit=names_commit and latest is not None))


# ---- events -------------------------------------------------------------------------------


def _on_worker(c: ControllerCore, event: FromWorker) -> None:
    on_workers.on_worker_message(c, event.msg)


def _on_refused(c: ControllerCore, event: RefusedFromWorker) -> None:
    on_workers.on_refused(c, event.attempt, event.rank, event.reason)


def _on_agent(c: ControllerCore, event: FromAgent) -> None:
    c.nodes.note_heard(event.node_id, c.now)
    handlers.on_agent_event(c, event.node_id, event.event)


def _on_table(c: ControllerCore, event: NodeTable) -> None:
    c.nodes.set_table(event.nodes, c.now)
    if isinstance(c.state, st.Placing):
        lifecycle.place(c, c.now)
    elif isinstance(c.state, st.Running):
        lifecycle.consider_grow(c, c.now)


def _on_agent_gone(c: ControllerCore, event: AgentGone) -> None:
    c.nodes.note_gone(event.node_id, event.why)


def _on_started(c: ControllerCore, event: Started) -> None:
    lifecycle.go(c, st.Event.STARTED, st.Placing(place_by=None))
    lifecycle.enter_placing(c, c.now)


def _on_lease_lost(c: ControllerCore, event: LeaseLost) -> None:
    if not c.state.kind.is_terminal:
        lifecycle.give_up(c, event.reason)


def _on_interrupted(c: ControllerCore, event: Interrupted) -> None:
    if not c.state.kind.is_terminal:
        lifecycle.go(c, st.Event.INTERRUPTED, st.Aborted(stop_by=lifecycle.stop_by(c, c.now)))
        lifecycle.stop_workers(c)


def _on_storage_done(c: ControllerCore, event: fx.StorageDone) -> None:
    effect, on_done = c.storage.pop(event.id, (None, None))
    if effect is None:
        return
    if c.storage_slow is not None and c.storage_slow.id == event.id:
        log.info("storage answered after %.0f s+: %s", c.storage_slow.for_s, c.storage_slow.what)
        c.storage_slow = None
    if event.warning is not None:
        log.warning("%s: %s", fx.describe(effect), event.warning)
    if on_done is not None:
        on_done(c, event)


def _on_storage_failed(c: ControllerCore, event: fx.StorageFailed) -> None:
    effect, _ = c.storage.pop(event.id, (None, None))
    if effect is None:
        return
    if c.storage_slow is not None and c.storage_slow.id == event.id:
        c.storage_slow = None
    checkpoints.on_storage_failed(c, effect, event)


def _on_storage_slow(c: ControllerCore, event: fx.StorageSlow) -> None:
    if event.id not in c.storage:
        return
    c.storage_slow = event
    log.warning("storage is slow: %s has taken %.0f s so far; the run goes on meanwhile (heartbeats and ranks are "
                "answered), and a commit waits for it", event.what, event.for_s)


ANSWERS = (fx.StorageDone, fx.ManifestWritten, fx.ChecksumsRead, fx.UploadsFound, fx.ManifestsRead)
STORAGE_EVENTS = (*ANSWERS, fx.StorageFailed, fx.StorageSlow, fx.TierAnswered)

EVENTS: dict[type, Callable] = {
    FromWorker: _on_worker, RefusedFromWorker: _on_refused, FromAgent: _on_agent, NodeTable: _on_table, AgentGone: _on_agent_gone,
    Started: _on_started, LeaseLost: _on_lease_lost, Interrupted: _on_interrupted, Tick: lambda c, e: None,
    **{answer: _on_storage_done for answer in ANSWERS}, fx.StorageFailed: _on_storage_failed, fx.StorageSlow: _on_storage_slow,
    fx.TierAnswered: memory_holds.on_tier_answered,
}


# ---- timers -------------------------------------------------------------------------------


def timers(c: ControllerCore, now: float) -> None:
    t = c.plan.timeouts
    if now >= c.next_heartbeat:
        beat = lifecycle.heartbeat(c)
        c.out += [ToNode(n, beat) for n in sorted(c.nodes.heard)]
        c.next_heartbeat = now + t.heartbeat_interval_s
    c.nodes.note_tick(now)
    if now >= c.next_query:
        c.out.append(QueryTable())
        c.next_query = now + TABLE_POLL_S
    for overdue in c.collectives.overdue(now):
        on_workers.on_overdue_collective(c, overdue)
    a = c.attempt
    if a is not None and now >= c.next_node_check:  # O(ranks): not on every message
        c.next_node_check = now + NODE_CHECK_S
        handlers.check_nodes(c, a, now)
    if c.state.kind.is_terminal:
        lifecycle.close_if_stopped(c, now)
        return
    if a is None or c.attempt is not a:
        return
    lifecycle.answer(c, c.horizons.tick(now))
    hang_steps.check_hangs(c, a, now)
    lifecycle.on_timers(c, a, now)
