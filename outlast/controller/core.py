"""The controller's core: `step(event, now) -> effects`, and nothing else touches the world.

What happened comes in as one event (`group.py`, and storage's answers, `effects.py`); what to
do goes out as effects: messages for agents and ranks, carried out by a worker group, and
storage calls, carried out by an executor off the loop (`executor.py`). The core never calls
storage, so nothing it does waits on it: heartbeats and answers to ranks go on while storage
is slow.

`ControllerCore` is the explicit state (`core_state.py`) and its one entry point. What each event
does is a plain function over that state, found in a table by the event's type: `handlers.py`
(agents, a worker's exit), `on_workers.py` (worker messages, collectives), `lifecycle.py`
(placing, restarting, failures), `ending.py` (giving up, finishing once settled, closing),
`memory_restore.py` (what a new attempt restores), `preempt_steps.py`, `hang_steps.py`. The
commit is a sub-machine with a state of its own (`commits/`): it gets its events with a frozen
view of the run and returns effects and outcomes, which `commit_steps.py` applies. Decisions
live in `states.py` (the table and the states' data), `policy.py` and `attempt_verdict.py`
(restart or raise), `placement.py`, `commit.py` (when a checkpoint is whole), `collectives.py`,
`horizons.py` and `preemption.py`. Time comes in as `now` (monotonic); the wall time for records
and deadlines comes from the injected `wall` clock. Teardown goes through this same path: a run is `closed` once its workers are gone (or
the wait for them is over) and storage has answered every effect.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from outlast.controller import (
    commit_steps, ending, handlers, hang_steps, lifecycle, live_steps, memory_restore, on_workers, preempt_steps,
)
from outlast.controller import effects as fx
from outlast.controller import states as st
from outlast.controller.core_state import CoreState
from outlast.controller.group import (
    AgentGone, Effect, FromAgent, FromWorker, InEvent, Interrupted, LeaseLost, LiveJoined, LiveReady, NodeTable,
    QueryTable,
    RefusedFromWorker, Started, Tick, ToNode,
)
from outlast.controller.heartbeat import heartbeat
from outlast.errors import TrainingFailedError
from outlast.protocol import messages as m
from outlast.storage.retry import RETRY_S_VAR

log = logging.getLogger("outlast.controller")

TABLE_POLL_S = 1.0
NODE_CHECK_S = 0.1


class ControllerCore(CoreState):
    # ---- the one entry point ----------------------------------------------------------

    def step(self, event: InEvent | fx.StorageEvent | fx.TierAnswered, now: float) -> list[Effect | fx.StorageEffect
                                                                                            | fx.TierAsk]:
        self.now = now
        if isinstance(self.state, st.Placing) and self.state.place_by is None and self.attempt is not None \
                and self.attempt.prepared and not isinstance(event, STORAGE_EVENTS):
            # The wait for a fresh table counts from the first event from outside after the step that asked
            # for it: the loop may have stalled meanwhile, and a table older than the stall is no table to place on.
            self.state = st.Placing(place_by=now + lifecycle.TABLE_WAIT_S)
        if not self.closed:
            closing = self.closing
            handler = EVENTS.get(type(event))
            if handler is not None and (not self.closing or type(event) in STORAGE_EVENTS):
                handler(self, event)
            if not self.closing:
                timers(self, now)
            if self.closing and not closing:
                commit_steps.run_ended(self)
            self.write_state()
            if self.closing and not self.storage and not self.commits.waits_for_frees(now):
                self.closed = True
        out, self.out = self.out, []
        return out


# ---- events -------------------------------------------------------------------------------


def _on_worker(c: ControllerCore, event: FromWorker) -> None:
    a = c.attempt
    if a is not None and event.msg.attempt == a.number:
        a.reply_to[event.msg.rank] = event.incarnation
        msg = event.msg
        if isinstance(msg, m.Report) and msg.checkpoint_dir is not None and not msg.upload_pending \
                and event.incarnation:  # a synchronous report() of a checkpoint: its process waits for the commit
            a.reported_by[(msg.rank, msg.index)] = event.incarnation
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
    c.go(st.Event.STARTED, st.Placing(place_by=None))
    lifecycle.enter_placing(c, c.now)


def _on_lease_lost(c: ControllerCore, event: LeaseLost) -> None:
    if not c.state.kind.is_terminal:
        ending.give_up(c, event.reason)


def _on_interrupted(c: ControllerCore, event: Interrupted) -> None:
    if not c.state.kind.is_terminal:
        c.go(st.Event.INTERRUPTED, st.Aborted(stop_by=ending.stop_by(c, c.now)))
        ending.stop_workers(c)


def _on_storage_done(c: ControllerCore, event: fx.StorageDone) -> None:
    effect = c.storage.pop(event.id, None)
    if effect is None:
        return
    if c.storage_slow is not None and c.storage_slow.id == event.id:
        log.info("storage answered after %.0f s+: %s", c.storage_slow.for_s, c.storage_slow.what)
        c.storage_slow = None
    if event.warning is not None:
        log.warning("%s: %s", fx.describe(effect), event.warning)
    ANSWERS[type(event)](c, event)


def _on_storage_failed(c: ControllerCore, event: fx.StorageFailed) -> None:
    """Storage still failed after its retries. A lost write fails the run; a lost delete leaves files."""
    effect = c.storage.pop(event.id, None)
    if effect is None:
        return
    if c.storage_slow is not None and c.storage_slow.id == event.id:
        c.storage_slow = None
    said = (f"storage failed {event.what} ({event.error}), retried for {RETRY_S_VAR} seconds; the latest "
            f"committed checkpoint stays {c.book.state.latest_checkpoint or 'none'}. Once storage is back, run "
            "fit() again with the same RunConfig(name, storage_path) to go on from there")
    if isinstance(effect, fx.DeleteCheckpoint):
        log.warning("could not delete checkpoint %s, which CheckpointConfig(num_to_keep=%s) lets go (%s); the run "
                    "goes on, and the files stay until deleted by hand", effect.checkpoint_dir, c.retention.num_to_keep,
                    event.error)
        return
    if isinstance(effect, (fx.WriteManifest, fx.ReadChecksums, fx.CheckUploads)):  # the commit machine's
        commit_steps.step(c, event)
    if isinstance(effect, fx.CheckUploads):  # not a write: the checkpoint is not committed, the run goes on
        return
    if not c.state.kind.is_terminal:
        ending.give_up(c, said)
    elif c.error is None:
        log.error("%s", said)
        c.error = TrainingFailedError(f"training failed: {said}", list(c.failures))


def _on_tier_answered(c: ControllerCore, event: fx.TierAnswered) -> None:
    pull = c.pulls.pop(event.id, None)
    if pull is not None:
        memory_restore.on_pulled(c, pull, event)
    else:
        commit_steps.step(c, event)


def _on_storage_slow(c: ControllerCore, event: fx.StorageSlow) -> None:
    if event.id not in c.storage:
        return
    c.storage_slow = event
    log.warning("storage is slow: %s has taken %.0f s so far; the run goes on meanwhile (heartbeats and ranks are "
                "answered), and a commit waits for it", event.what, event.for_s)


# Storage's answers, by what they say: the commit machine asked for the manifests written, the checksums read and
# the uploads found; a new attempt for the manifests read; the rest (run states, deletes) needs nothing more.
ANSWERS: dict[type, Callable[[CoreState, Any], None]] = {
    fx.StorageDone: lambda c, e: None, fx.ManifestWritten: commit_steps.step, fx.ChecksumsRead: commit_steps.step,
    fx.UploadsFound: commit_steps.step, fx.ManifestsRead: lifecycle.on_manifests_read,
}
STORAGE_EVENTS = (*ANSWERS, fx.StorageFailed, fx.StorageSlow, fx.TierAnswered)

EVENTS: dict[type, Callable[[ControllerCore, Any], None]] = {
    FromWorker: _on_worker, RefusedFromWorker: _on_refused, FromAgent: _on_agent, NodeTable: _on_table, AgentGone: _on_agent_gone,
    Started: _on_started, LeaseLost: _on_lease_lost, Interrupted: _on_interrupted, Tick: lambda c, e: None,
    **{answer: _on_storage_done for answer in ANSWERS}, fx.StorageFailed: _on_storage_failed, fx.StorageSlow: _on_storage_slow,
    fx.TierAnswered: _on_tier_answered, LiveJoined: live_steps.on_joined, LiveReady: live_steps.on_ready,
}


# ---- timers -------------------------------------------------------------------------------


def timers(c: ControllerCore, now: float) -> None:
    t = c.plan.timeouts
    if now >= c.next_heartbeat:
        beat = heartbeat(c)
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
        ending.close_if_stopped(c, now)
        return
    if a is None or c.attempt is not a:
        return
    preempt_steps.answer(c, c.horizons.tick(now))
    live_steps.publish_if_ready(c)
    hang_steps.check_hangs(c, a, now)
    commit_steps.on_timers(c)
    lifecycle.on_timers(c, a, now)
