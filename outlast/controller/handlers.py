"""What the controller's core does with each message from a worker or a node agent.

A part of `ControllerCore` (`core.py`), kept apart to keep each module to one page of
concerns: this one turns messages into state changes; the core owns the states,
timers and effects.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from outlast.controller import checkpoints
from outlast.controller import states as st
from outlast.controller.commit import PendingCheckpoint
from outlast.controller.group import ForgetNode
from outlast.controller.preemption import Preemption
from outlast.controller.resize import Resize
from outlast.controller.states import Event, State
from outlast.controller.types import AttemptState
from outlast.controller.upload_estimate import Estimate
from outlast.protocol import messages as m
from outlast.protocol.kinds import FailureKind
from outlast.storage.records import FailureRecord

if TYPE_CHECKING:
    from outlast.controller.core import ControllerCore

log = logging.getLogger("outlast.controller")

_PREEMPTED = (State.PREEMPTING, State.SAVED)


class Handlers:
    # ---- agents ----------------------------------------------------------------------

    def _on_agent_event(self: "ControllerCore", node_id: str, event: m.AgentEvent) -> None:
        a = self.attempt
        if isinstance(event, m.WorkerExited):
            self._on_worker_exited(event)
        elif isinstance(event, m.WorkerStarted):
            if a is not None and event.attempt == a.number and event.run_id == self.run_id:
                a.pids[event.rank] = event.pid
                self.book.note_output_file(event.rank, a.placement.get(event.rank, ""), event.output_file)
        elif isinstance(event, m.NodeDraining):
            self._on_node_draining(event)
        elif isinstance(event, m.SpawnRefused):
            self._on_spawn_refused(node_id, event)
        elif isinstance(event, m.Pong):
            self.nodes.note_pid(node_id, event.pid)

    def _on_node_draining(self: "ControllerCore", notice: m.NodeDraining) -> None:
        a, s, now = self.attempt, self.state, self._now
        nodes = set(notice.node_ids) | {notice.node_id}
        self.nodes.note_draining(notice)
        grace = self.plan.preemption_grace_s
        if isinstance(s, st.Preempting) and isinstance(s.preemption, Resize) and a is not None \
                and nodes & set(a.placement.values()):
            # A drain during a pending grow is a preemption of its own: the ranks hear of the drain (its nodes,
            # ranks and deadline) from now on, and a checkpoint saved for the grow answers it too.
            grow = s.preemption
            p = Preemption.begin(notice, a.placement, sorted(nodes & set(a.placement.values())),
                                 grow.reports_at_notice, now, self.wall(), grace, exited=a.exited)
            p.jit_reports |= grow.jit_reports
            log.warning("node %s is draining (%s: %s) while the run was to grow; ranks %s of attempt %d are "
                        "preempted, and every rank has %.1f s to save a checkpoint", ", ".join(p.node_ids),
                        notice.reason, notice.message, p.ranks, a.number, p.deadline - now)
            self.state = st.Preempting(p)
            a.preemption = p
            return
        if isinstance(s, (st.Preempting, st.Saved)):
            added = s.preemption.widen(notice, a.placement, a.exited) if a is not None else []
            if added:
                log.warning("node%s %s of attempt %d %s draining too; ranks %s are preempted", "s"[:len(added) - 1],
                            ", ".join(added), a.number, "are" if len(added) > 1 else "is", s.preemption.ranks)
            left = s.preemption.tighten(notice, now, self.wall(), grace)
            if left is not None:
                log.warning("node %s is draining too, with an earlier deadline; the run has %.1f s",
                            notice.node_id, left)
            return
        if a is None or s.kind not in (State.SCHEDULING, State.RUNNING):
            return  # between attempts: the next placement avoids the draining nodes
        p = Preemption.begin(notice, a.placement, sorted(nodes & set(a.placement.values())), self.commits.reports,
                             now, self.wall(), grace, exited=a.exited)
        if not p.ranks:
            return
        ranks = p.ranks
        log.warning("node %s is draining (%s: %s); ranks %s of attempt %d are preempted, and every rank has %.1f s "
                    "to save a checkpoint", ", ".join(p.node_ids), notice.reason, notice.message, ranks,
                    a.number, p.deadline - now)
        self._go(Event.PREEMPTION_NOTICE, st.Preempting(p))
        for rank in a.exited:  # a rank that already returned asks nothing more
            self.horizons.lose_rank(rank, now)
        self._answer(self.horizons.preempt(now))

    def _jit_uploads(self: "ControllerCore", p: Preemption, now: float) -> Estimate:
        """The uploads of the checkpoint saved for the notice: they go before any other (storage/priority.py)."""
        return self.uploads.estimate(now, only=p.after_notice)

    def _forecast_uploads(self: "ControllerCore", p: Preemption) -> None:
        text = p.forecast(self._now, self._jit_uploads(p, self._now), self.book.state.latest_checkpoint)
        if text is not None:
            assert self.attempt is not None
            log.warning("attempt %d: %s", self.attempt.number, text)
            self.book.note_once(f"attempt {self.attempt.number}: {text}", self.wall())

    def _on_spawn_refused(self: "ControllerCore", node_id: str, refused: m.SpawnRefused) -> None:
        """A node turned the workers away (it began draining after we placed them): place again."""
        a = self.attempt
        if a is None or refused.attempt != a.number:
            return
        if self.state.kind is State.SCHEDULING:
            log.warning("attempt %d: %s; placing it again", a.number, refused.reason)
            self._on_failure(FailureRecord(attempt=a.number, rank=0, node_id="", pid=0, exit_code=None, signal=None,
                                           time=self.wall(), exc_type=FailureKind.SPAWN_REFUSED, message=refused.reason))
        # Those ranks never started, whatever the state by now; the other nodes' ranks report their exit.
        for rank in a.ranks_on({node_id}):
            a.exited.setdefault(rank, m.WorkerExited(run_id=self.run_id, attempt=a.number, rank=rank, pid=0,
                                                     exit_code=None, signal=None, error=None, node_id=node_id))
        self._settle_if_all_exited()

    def _check_nodes(self: "ControllerCore", a: AttemptState, now: float) -> None:
        """A node lost with workers of this attempt: its ranks failed (or, preempted, are let go)."""
        live = {n for r, n in a.placement.items() if r not in a.exited}
        for node_id, why in self.nodes.lost_nodes(now, live).items():
            log.warning("%s; its ranks %s of attempt %d are lost", why, a.ranks_on({node_id}), a.number)
            self.nodes.lose(node_id, now)
            self._out.append(ForgetNode(node_id))
            for rank in a.ranks_on({node_id}):
                if rank in a.exited:
                    continue
                self._on_worker_exited(m.WorkerExited(
                    run_id=self.run_id, attempt=a.number, rank=rank, pid=a.pids.get(rank, 0), exit_code=None,
                    signal=None, node_id=node_id,
                    error=m.WorkerError(exc_type=FailureKind.NODE_LOST, message=why, traceback="", phase="train")))
                if self.closed or self.attempt is not a:
                    return

    def _on_worker_exited(self: "ControllerCore", ev: m.WorkerExited) -> None:
        a, s = self.attempt, self.state
        if a is None or ev.run_id != self.run_id or ev.attempt != a.number or ev.rank in a.exited:
            return
        a.exited[ev.rank] = ev
        failed = ev.exit_code != 0 or ev.error is not None
        p = self._preemption()
        if s.kind in _PREEMPTED and self.plan.relax_collectives and p is not None and ev.rank in p.ranks:
            self._lose_preempted_rank(a, p, ev, failed)
        elif failed and not (s.kind is State.RESTARTING and ev.error is None and ev.signal is not None):
            # (while restarting, a death by a signal alone is our own stop: SIGTERM, or SIGKILL after its grace)
            self._on_failure(_failure_record(ev, self.wall()))
        elif s.kind in _PREEMPTED:
            # The others go on saving; if every rank returns, the training is over and the run finishes.
            log.warning("rank %d returned from the train function during a preemption", ev.rank)
            self._answer(self.horizons.lose_rank(ev.rank, self._now))
        if self.attempt is not a:
            return
        if self.state.kind is State.RESTARTING:
            self._settle_if_all_exited()
        elif self.state.kind.has_live_workers and a.all_exited(self.plan.world_size):
            if self._settled(a):
                self._finish()
            else:
                self._go(Event.ALL_EXITED, st.Finishing(since=self._now))
        elif self.state.kind.is_terminal:
            self._close_if_stopped(self._now)

    def _lose_preempted_rank(self: "ControllerCore", a: AttemptState, p: Preemption, ev: m.WorkerExited,
                             failed: bool) -> None:
        """Relaxed collectives: the survivors go on without a rank of a preempted node."""
        a.lost.add(ev.rank)
        if failed:
            a.failures.append(_failure_record(ev, self.wall()))
        log.warning("rank %d (on preempted node %s) is gone; ranks %s go on without it", ev.rank, ev.node_id,
                    sorted(set(range(self.plan.world_size)) - a.lost))
        self._answer(self.horizons.lose_rank(ev.rank, self._now))
        outcome = self.commits.lose_ranks({ev.rank})
        for pending in outcome.settled:
            self._commit(pending)
            if self.state.kind not in _PREEMPTED:
                return
        for done in self.collectives.lose_ranks({ev.rank}):
            self._reply_collective(done)
        if a.all_exited(self.plan.world_size) and self.state.kind in _PREEMPTED:
            self._restart(Event.PREEMPTION_SAFE, p)

    def _on_failure(self: "ControllerCore", record: FailureRecord) -> None:
        """The first failure ends the attempt; the cause is judged once every worker has exited."""
        assert self.attempt is not None
        self.attempt.failures.append(record)
        # The first failure is written at once; the rest (often every rank's exit in the teardown)
        # with the attempt's settlement, not one run-state write each.
        self.book.add_failure(record, save=self.state.kind.has_live_workers)
        if self.state.kind.has_live_workers:
            self.attempt.failed = True
            self._restart(Event.WORKER_FAILED, self._preemption())

    # ---- workers ---------------------------------------------------------------------

    def _on_worker_message(self: "ControllerCore", msg: m.WorkerMessage) -> None:
        a = self.attempt
        if a is None or msg.attempt != a.number:
            return  # a straggler of an attempt that was torn down
        if isinstance(msg, m.Report):
            self._on_report(msg)
        elif isinstance(msg, m.UploadDone):
            self.uploads.on_upload_done(msg.rank, msg.index)
            for pending in self.commits.on_upload_done(msg.rank, msg.index, msg.checkpoint_dir, msg.files, msg.error):
                self._commit(pending)
            if self.state.kind is State.FINISHING and self._settled(a):
                self._finish()
        elif isinstance(msg, m.WorkerHello):
            a.hello.add(msg.rank)
            if self.state.kind is State.SCHEDULING and len(a.hello) == self.plan.world_size:
                self._go(Event.WORKERS_STARTED, st.Running())
        elif isinstance(msg, m.CollectiveRequest):
            self._on_collective(msg)
        elif isinstance(msg, m.PreemptionQuery):
            self._answer(self.horizons.on_query(msg.rank, msg.index, self._now))
        elif isinstance(msg, (m.Progress, m.StackDump)):
            self._on_watch_message(msg)
        elif isinstance(msg, m.WorkerDone):
            a.done.add(msg.rank)
            if self.state.kind is State.FINISHING and self._settled(a):
                self._finish()

    def _settled(self: "ControllerCore", a: AttemptState) -> bool:
        """Every rank said it is done, and every asynchronous upload it reported said so too. The
        upload thread has a connection of its own, so its last UploadDone may arrive after the
        rank's WorkerDone and its exit: finishing before it would drop the last checkpoint."""
        return a.done >= set(range(self.plan.world_size)) and not self.commits.uploads_in_flight

    def _on_report(self: "ControllerCore", msg: m.Report) -> None:
        p = self._preemption()
        if msg.saw_preemption and p is not None:
            p.jit_reports.add((msg.rank, msg.index))
        if msg.rank == 0:
            self.last_metrics = msg.metrics
        if msg.upload_pending and msg.checkpoint_dir is not None:
            self.uploads.on_report(msg.rank, msg.index, msg.upload_bytes, msg.upload_bandwidth_bps, self._now)
            if p is not None:
                self._forecast_uploads(p)
        try:
            ready = self.commits.on_report(msg.rank, msg.index, msg.checkpoint_dir, msg.files, msg.metrics,
                                           msg.upload_pending)
        except ValueError as e:
            log.warning("ignored a report: %s", e)
            return
        for pending in ready:
            self._commit(pending)

    def _commit(self: "ControllerCore", pending: PendingCheckpoint) -> None:
        a = self.attempt
        assert a is not None
        reply = checkpoints.commit(self.book, pending, a.number, a.placement, self.retention,
                                    self.plan.duplicate_files, self.wall())
        s = self.state
        if isinstance(s, st.Preempting) and isinstance(reply, m.Committed) \
                and s.preemption.saved_by(pending.index, pending.files, self.horizons.watched):
            verdict = s.preemption.decide(self._now, pending.checkpoint_dir, self._room_elsewhere(self._now))
            if verdict.restart_now:
                # The ranks stay blocked in that report() until the teardown reaches them: a step
                # they took after it would be lost.
                log.info("%s; restarting now", verdict.reason)
                self._restart(Event.PREEMPTION_SAFE, s.preemption)
                return
            log.warning("%s", verdict.reason)
            self._go(Event.SAVED_NOWHERE_TO_GO, st.Saved(s.preemption, pending.checkpoint_dir))
            if s.preemption.notice.until_commit:
                # Its nodes go away now that it is committed (a Slurm job is requeued): nothing the loop
                # does from here is kept, so the ranks that wait for it wait until the teardown.
                log.info("attempt %d: checkpoint %s is the last this attempt commits (the drain ends with it); "
                         "its ranks wait in report() until the run stops", a.number, pending.checkpoint_dir)
                return
        for rank in sorted(pending.waiting):
            self._send_to_rank(rank, reply)
        s = self.state
        if isinstance(s, (st.Preempting, st.Saved)) and pending.missing_shards:
            # Waiting longer cannot bring a lost shard back.
            log.warning("restarting from %s now", self.book.state.latest_checkpoint or "scratch")
            self._restart(Event.PREEMPTION_SAFE, s.preemption)

    # ---- collectives -----------------------------------------------------------------

    def _on_collective(self: "ControllerCore", msg: m.CollectiveRequest) -> None:
        try:
            complete = self.collectives.arrive(msg.rank, msg.seq, msg.op, msg.payload, self._now)
        except ValueError as e:
            log.error("%s", e)
            return
        if complete is not None:
            self._reply_collective(complete)

    def _reply_collective(self: "ControllerCore", complete) -> None:
        reply = m.CollectiveReply(seq=complete.seq, payload=complete.payload)
        for rank in range(self.plan.world_size):
            if rank not in self.collectives.lost:
                self._send_to_rank(rank, reply)

    def _on_overdue_collective(self: "ControllerCore", o) -> None:
        if not o.timed_out:
            log.warning("%s #%d has waited %.0f s for ranks %s", o.op, o.seq, o.waited_s, o.missing)
            return
        reply = m.CollectiveTimeout(seq=o.seq, op=o.op, missing_ranks=o.missing, waited_s=o.waited_s)
        for rank in o.arrived:
            self._send_to_rank(rank, reply)


def _failure_record(ev: m.WorkerExited, wall: float) -> FailureRecord:
    err = ev.error
    return FailureRecord(
        attempt=ev.attempt, rank=ev.rank, node_id=ev.node_id, pid=ev.pid, exit_code=ev.exit_code,
        signal=ev.signal, time=wall,
        exc_type=err.exc_type if err else None, message=err.message if err else None,
        traceback=err.traceback if err else None, phase=err.phase if err else None,
        oom_report=ev.oom_report,
    )
