"""The controller's core: `step(event, now) -> effects`, and nothing else touches the world.

What happened comes in as one event (`group.py`); what to do goes out as effects, carried
out by a worker group. Decisions live in `states.py` (the table and the states' data),
`policy.py` and `settle.py` (restart or raise), `placement.py`, `commit.py` (when a
checkpoint is whole), `checkpoints.py` (its writes), `collectives.py`, `horizons.py` and
`preemption.py`. Time comes in as `now` (monotonic); the wall time for records and
deadlines comes from the injected `wall` clock. Teardown goes through this same path:
a run is `closed` once its workers are gone (or the wait for them is over).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from outlast.controller import checkpoints, resize
from outlast.controller import states as st
from outlast.controller.collectives import CollectiveTracker
from outlast.controller.commit import CommitTracker
from outlast.controller.handlers import Handlers
from outlast.controller.hang_steps import HangSteps
from outlast.controller.group import (
    AgentGone, Effect, FromAgent, FromWorker, InEvent, Interrupted, LeaseLost, NodeTable, QueryTable,
    Spawn, Started, StopRun, ToNode, ToRank,
)
from outlast.controller.horizons import Answer, Decision, HorizonBook
from outlast.controller.nodes import NodeBook
from outlast.controller.placement import NoCapacity
from outlast.controller.policy import caused_by_drain
from outlast.controller.preemption import Preemption
from outlast.controller.settle import settle_attempt
from outlast.controller.states import Event, State
from outlast.controller.types import AttemptState, RunPlan
from outlast.controller.upload_estimate import UploadEstimate
from outlast.protocol import messages as m
from outlast.storage.records import FailureRecord
from outlast.errors import TrainingFailedError

log = logging.getLogger("outlast.controller")

TABLE_POLL_S = 1.0
TABLE_WAIT_S = 1.0  # how long a new attempt waits for a fresh node table before placing on the last one
CAPACITY_RETRY_S = 1.0
TEARDOWN_EXTRA_S = 5.0
NODE_CHECK_S = 0.1


class ControllerCore(Handlers, HangSteps):
    def __init__(self, plan: RunPlan, run_id: str, address: str, wall: Callable[[], float]) -> None:
        self.plan = plan
        self.run_id = run_id
        self.address = address  # where workers reach the controller
        self.wall = wall
        self.book = plan.book
        self.state: st.AnyState = st.Initializing()
        self.nodes = NodeBook(plan.timeouts.node_lost_after_s)
        self.attempt: AttemptState | None = None
        self.commits = CommitTracker(plan.world_size)
        self.collectives = self._new_collectives()
        self.horizons = HorizonBook()
        self.uploads = UploadEstimate()  # the attempt's checkpoint uploads in flight
        self.resizes = resize.Resizes(plan.elastic)
        self.retention = checkpoints.RetentionRule(plan.num_to_keep, plan.score_attribute, plan.score_order)
        self.last_metrics: dict | None = None
        self.failures: list[FailureRecord] = []
        self.error: TrainingFailedError | None = None
        self.closed = False
        self._out: list[Effect] = []
        self._now = 0.0
        self._next_heartbeat = float("-inf")
        self._next_query = float("-inf")
        self._next_node_check = float("-inf")

    # ---- the one entry point ----------------------------------------------------------

    def step(self, event: InEvent, now: float) -> list[Effect]:
        self._now = now
        if isinstance(self.state, st.Placing) and self.state.place_by is None:
            # The wait for a fresh table counts from after the step that asked for it: that step may
            # have spent long on storage, and a table older than the stall is no table to place on.
            self.state = st.Placing(place_by=now + TABLE_WAIT_S)
        if not self.closed:
            self._on(event, now)
            if not self.closed:
                self._timers(now)
        out, self._out = self._out, []
        return out

    def _on(self, event: InEvent, now: float) -> None:
        if isinstance(event, FromWorker):
            self._on_worker_message(event.msg)
        elif isinstance(event, FromAgent):
            self.nodes.note_heard(event.node_id, now)
            self._on_agent_event(event.node_id, event.event)
        elif isinstance(event, NodeTable):
            self.nodes.set_table(event.nodes)
            if isinstance(self.state, st.Placing):
                self._place(now)
            elif isinstance(self.state, st.Running):
                self._consider_grow(now)
        elif isinstance(event, AgentGone):
            self.nodes.note_gone(event.node_id, event.why)
        elif isinstance(event, Started):
            self._go(Event.STARTED, st.Placing(place_by=None))
            self._enter_placing(now)
        elif isinstance(event, LeaseLost):
            if not self.state.kind.is_terminal:
                self._give_up(event.reason)
        elif isinstance(event, Interrupted):
            if not self.state.kind.is_terminal:
                self._go(Event.INTERRUPTED, st.Aborted(stop_by=self._stop_by(now)))
                self._stop_workers()

    def _timers(self, now: float) -> None:
        t = self.plan.timeouts
        if now >= self._next_heartbeat:
            beat = self._heartbeat()
            self._out += [ToNode(n, beat) for n in sorted(self.nodes.heard)]
            self._next_heartbeat = now + t.heartbeat_interval_s
        self.nodes.note_tick(now)
        if now >= self._next_query:
            self._out.append(QueryTable())
            self._next_query = now + TABLE_POLL_S
        for overdue in self.collectives.overdue(now):
            self._on_overdue_collective(overdue)
        a = self.attempt
        if a is not None and now >= self._next_node_check:  # O(ranks): not on every message
            self._next_node_check = now + NODE_CHECK_S
            self._check_nodes(a, now)
        if self.state.kind.is_terminal:
            self._close_if_stopped(now)
            return
        if a is None or self.attempt is not a:
            return
        self._answer(self.horizons.tick(now))
        self._check_hangs(a, now)
        s = self.state
        if isinstance(s, st.Placing) and s.place_by is not None and now >= s.place_by:
            self._place(now)
        elif isinstance(s, st.WaitingForCapacity) and now >= s.retry_at:
            self._place(now)
        elif isinstance(s, st.Scheduling) and now - s.since > t.worker_start_s:
            missing = sorted(set(range(self.plan.world_size)) - a.hello)
            self._give_up(f"ranks {missing} of attempt {a.number} did not start within {t.worker_start_s:.0f} s "
                          "(OUTLAST_WORKER_START_TIMEOUT_S); is a node's fork server stuck? `outlast status` "
                          "and the nodes' logs tell")
        elif isinstance(s, (st.Preempting, st.Saved)):
            saved = s.checkpoint if isinstance(s, st.Saved) else None
            verdict = s.preemption.decide(now, saved, saved is not None and self._room_elsewhere(now),
                                          self._jit_uploads(s.preemption, now))
            if verdict.restart_now:
                log.warning("attempt %d: %s; restarting from %s now", a.number, verdict.reason,
                            self.book.state.latest_checkpoint or "scratch")
                self._restart(Event.PREEMPTION_SAFE, s.preemption)
        elif isinstance(s, st.Finishing) and now - s.since > t.finish_settle_s:
            log.warning("finishing without the last messages of ranks %s%s",
                        sorted(set(range(self.plan.world_size)) - a.done),
                        "; an asynchronous upload never said it was done, so its checkpoint is not committed"
                        if self.commits.uploads_in_flight else "")
            self._finish()

    # ---- states ------------------------------------------------------------------------

    def _go(self, event: Event, new: st.AnyState) -> None:
        """Move to `new`, which must be the state the table gives for this event."""
        expected = st.transition(self.state.kind, event)
        if expected is not new.kind:
            raise st.InvalidTransition(f"{self.state.kind.value} on {event.value} leads to {expected.value}, "
                                       f"not {new.kind.value}")
        log.debug("%s --%s--> %s", self.state.kind.value, event.value, new.kind.value)
        self.state = new
        p = getattr(new, "preemption", None)
        if p is not None and self.attempt is not None:
            self.attempt.preemption = p

    def _enter_placing(self, now: float) -> None:
        checkpoints.remove_uncommitted(self.book)
        wall = self.wall()
        number = self.book.begin_attempt(wall)
        self.attempt = a = AttemptState(number=number, started_at=now)
        a.restore = restore = checkpoints.restorable(self.book, wall)
        self.commits = CommitTracker(self.plan.world_size,
                                     shard_holders=checkpoints.shard_holders(self.book, restore))
        self.collectives = self._new_collectives()
        self.horizons = HorizonBook()
        self.uploads.clear()
        if number > 1 or restore:
            log.info("starting attempt %d of run %s%s", number, self.plan.name,
                     f", restoring {restore}" if restore else " from scratch")
        if number > 1:  # place on what the head knows now, if it answers within a second
            self._out.append(QueryTable())
        else:
            self._place(now)

    def _place(self, now: float) -> None:
        """Place every rank on a node that is alive and not draining, or wait for one (bounded)."""
        a, s = self.attempt, self.state
        assert a is not None
        placed = self.resizes.place(self.nodes.views(self.run_id, now), self.plan.world_size, self.plan.per_worker,
                                    self.plan.strategy)
        if isinstance(placed, NoCapacity):
            self._out.append(QueryTable())
            if isinstance(s, st.WaitingForCapacity):
                if now - s.since > self.plan.timeouts.capacity_s:
                    self._give_up(f"no capacity for attempt {a.number} within {self.plan.timeouts.capacity_s:.0f} s:"
                                  f" {placed.reason}. Add a node (outlast start --address HEAD) or raise "
                                  "OUTLAST_CAPACITY_TIMEOUT_S")
                    return
                self.state = st.WaitingForCapacity(s.since, placed.reason, now + CAPACITY_RETRY_S)
                return
            log.warning("attempt %d is waiting for capacity: %s (nodes: %s); retrying for at most %.0f s "
                        "(OUTLAST_CAPACITY_TIMEOUT_S)", a.number, placed.reason, self.nodes.describe(),
                        self.plan.timeouts.capacity_s)
            self.book.set_waiting(placed.reason, self.wall())
            self._go(Event.NO_CAPACITY, st.WaitingForCapacity(now, placed.reason, now + CAPACITY_RETRY_S))
            return
        if isinstance(s, st.WaitingForCapacity):
            log.info("attempt %d found capacity after %.1f s", a.number, now - s.since)
            self.book.set_waiting(None, self.wall())
        a.started_at = now
        a.placement = {spec.rank: node.node_id for node, spec in placed.workers}
        self._size_attempt(a, len(placed.workers), now)
        self._go(Event.PLACED, st.Scheduling(since=now))
        by_node: dict[str, list[m.WorkerSpec]] = {}
        for node, spec in placed.workers:
            by_node.setdefault(node.node_id, []).append(spec)
        env = dict(self.plan.env)
        if self.plan.rendezvous:  # torch.distributed meets at rank 0's node
            env["MASTER_ADDR"] = self.nodes.nodes[a.placement[0]].host
        if self.plan.relax_collectives:
            env["OUTLAST_RELAX_COLLECTIVES"] = "1"
        if len(by_node) > 1:
            log.info("attempt %d: ranks placed on %s", a.number,
                     ", ".join(f"{n} {[s.rank for s in specs]}" for n, specs in by_node.items()))
        for node_id, specs in by_node.items():
            if self.nodes.link(node_id, now):
                self._out.append(ToNode(node_id, self._heartbeat()))  # the agent knows the run before its workers
            self._out.append(Spawn(node_id, m.SpawnWorkers(
                run_id=self.run_id, attempt=a.number, controller_address=self.address, workers=specs,
                payload=self.plan.payload, env=env, cwd=self.plan.cwd, sys_path=self.plan.sys_path,
                run_name=self.plan.name, restore_checkpoint=a.restore, resources=self.plan.per_worker,
                run_key=self.book.store.storage.uri(self.book.store.run_dir), forward_output=self.plan.forward_output,
                agent_pid=self.nodes.nodes[node_id].agent_pid,
            )))

    def _restart(self, event: Event, preemption: Preemption | None) -> None:
        """The attempt is over (failed, or preempted): stop its workers; settle once all have exited."""
        self._go(event, st.Restarting(preemption))
        self._stop_workers()
        self._settle_if_all_exited()

    def _settle_if_all_exited(self) -> None:
        a, s = self.attempt, self.state
        if not isinstance(s, st.Restarting) or a is None or not a.all_exited(self.plan.world_size):
            return
        p = self.plan
        preemption = s.preemption
        if preemption is not None and a.failed and not caused_by_drain(a.failures, {*preemption.node_ids}):
            log.warning("attempt %d failed while it saved for the drain of %s, for a cause of its own: charged to "
                        "max_failures", a.number, ", ".join(preemption.node_ids) or preemption.notice.node_id)
            preemption = None
        preemption = preemption or self._preempted_by_drain(a)
        settled = self.resizes.settle(self.book, a.number, p.world_size, a.failures, preemption, self.commits.reports,
                                      self.wall()) \
            or settle_attempt(self.book, a.number, a.failures, self.failures, resize.for_settling(preemption),
                              p.max_failures, p.max_preemption_failures, self.wall())
        if settled.retry:
            self._go(Event.RETRY, st.Placing(place_by=None))
            self._enter_placing(self._now)
            return
        self.error = settled.error
        self._go(Event.GIVE_UP, st.Errored(error=settled.error, stop_by=self._now))
        self._close_if_stopped(self._now)

    def _preempted_by_drain(self, a: AttemptState) -> Preemption | None:
        """An attempt that failed because a drained node went away (a deadline of 0 s, or a notice that came
        after the failure it caused) was preempted: it draws on the preemption budget, not max_failures.
        Only when every failure is on a drained node or a symptom of one: a cause elsewhere is not the drain's."""
        drained = {n: d for n in sorted(set(a.placement.values())) if (d := self.nodes.drain_of(n)) is not None}
        if not drained or not a.failures:
            return None
        if not caused_by_drain(a.failures, set(drained)):
            return None
        notice = next(iter(drained.values()))
        return Preemption.begin(notice, a.placement, sorted(drained), self.commits.reports, self._now, self.wall(),
                                self.plan.preemption_grace_s)

    def _give_up(self, reason: str) -> None:
        self.error = TrainingFailedError(f"training failed: {reason}", list(self.failures))
        log.error("%s", reason)
        self._go(Event.UNRECOVERABLE, st.Errored(error=self.error, stop_by=self._stop_by(self._now)))
        self._stop_workers()
        self._close_if_stopped(self._now)

    def _finish(self) -> None:
        self._go(Event.ALL_FINISHED, st.Finished())
        self._close_if_stopped(self._now)

    def _stop_by(self, now: float) -> float:
        return now + self.plan.timeouts.teardown_grace_s + TEARDOWN_EXTRA_S

    def _stop_workers(self) -> None:
        a = self.attempt
        if a is None:
            return
        self._answer(self.horizons.release())  # no rank waits on a decision while it is stopped
        stop = m.StopWorkers(run_id=self.run_id, attempt=a.number, grace_s=self.plan.timeouts.teardown_grace_s)
        for node_id in sorted(set(a.placement.values())):
            if node_id in self.nodes.heard:
                self._out.append(StopRun(node_id, stop))

    def _close_if_stopped(self, now: float) -> None:
        """A terminal state closes the run once its workers are gone, or the wait for them is over."""
        s, a = self.state, self.attempt
        if self.closed:
            return
        if isinstance(s, (st.Errored, st.Aborted)) and a is not None and now < s.stop_by:
            expected = {r for r, n in a.placement.items() if n in self.nodes.heard}
            if not expected <= set(a.exited):
                return
        checkpoints.remove_uncommitted(self.book)
        outcome = {State.FINISHED: "finished", State.ERRORED: "failed", State.ABORTED: "aborted"}[s.kind]
        self.book.end_attempt(outcome, self.wall())
        self.book.finish(s.kind.value, error=str(self.error) if isinstance(s, st.Errored) else None,
                         last_metrics=self.last_metrics)
        self._out += [ToNode(n, m.EndRun(run_id=self.run_id)) for n in sorted(self.nodes.heard)]
        self.closed = True

    # ---- helpers --------------------------------------------------------------------

    def _new_collectives(self) -> CollectiveTracker:
        return CollectiveTracker(self.plan.world_size, self.plan.timeouts.collective_warn_s,
                                 self.plan.timeouts.collective_timeout_s)

    def _heartbeat(self) -> m.RunHeartbeat:
        return m.RunHeartbeat(run_id=self.run_id, timeout_s=self.plan.timeouts.driver_lost_after_s,
                              last_commit_at=self._last_commit_this_attempt())

    def _last_commit_this_attempt(self) -> float | None:
        """What a kill would throw away starts here (None: the attempt's start, as the agent knows it)."""
        a, latest = self.attempt, self.book.state.checkpoints[-1:]
        if a is None or not latest or latest[0].attempt != a.number:
            return None
        return latest[0].committed_at

    def _room_elsewhere(self, now: float) -> bool:
        return self.resizes.room_elsewhere(self.nodes.views(self.run_id, now), self.plan.world_size,
                                           self.plan.per_worker, self.plan.strategy)

    # ---- elastic runs (resize.py decides) -------------------------------------------------

    def _size_attempt(self, a: AttemptState, workers: int, now: float) -> None:
        """An elastic attempt's world is what was placed: the trackers count its ranks, not the last one's."""
        if workers != self.plan.world_size:
            self.plan = dataclasses.replace(self.plan, world_size=workers)
            holders = checkpoints.shard_holders(self.book, a.restore)
            self.commits = CommitTracker(workers, shard_holders=None if holders is None else
                                         {r for r in holders if r < workers})
            self.collectives = self._new_collectives()
        record = self.resizes.placed(self.book, a.number, workers, now, self.wall())
        if record is not None:
            log.warning("attempt %d runs on %d workers, was %d: %s (%d steps lost)", a.number, record.to_workers,
                        record.from_workers, record.reason, record.steps_lost)

    def _consider_grow(self, now: float) -> None:
        a = self.attempt
        grow = self.resizes.consider_grow(self.nodes.views(self.run_id, now), self.plan.world_size,
                                          self.plan.per_worker, self.plan.strategy, now)
        if a is None or grow.to_workers is None or a.exited:
            return
        p = resize.grow_notice(grow, self.plan.world_size, self.commits.reports, now, self.wall())
        log.warning("attempt %d: %s; the loop is told to save a checkpoint (get_preemption_info().reason == %r)",
                    a.number, p.notice.message, resize.RESIZE)
        self._go(Event.PREEMPTION_NOTICE, st.Preempting(p))
        self._answer(self.horizons.preempt(now))

    def _preemption(self) -> Preemption | None:
        return getattr(self.state, "preemption", None)

    def _answer(self, answers: list[Answer]) -> None:
        a = self.attempt
        p = self._preemption() or (a.preemption if a is not None else None)
        for ans in answers:
            if isinstance(ans.reply, Decision):
                # A decision is only ever fixed after a notice, and the attempt keeps its preemption.
                assert p is not None and a is not None, "a preemption decision without a preemption"
                msg: m.Msg = p.notice_message(ans.index, ans.reply.decision_index)
            else:
                msg = m.PreemptionGrant(index=ans.index, horizon=ans.reply.horizon, valid_s=ans.reply.valid_s)
            self._send_to_rank(ans.rank, msg)

    def _send_to_rank(self, rank: int, msg: m.Msg) -> None:
        assert self.attempt is not None
        self._out.append(ToRank(self.attempt.number, rank, msg))
