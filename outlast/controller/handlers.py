"""What the controller's core does with each event from a node agent: a worker's start and exit, a drain,
a refused spawn, a node lost.

Plain functions over the core's state (`core_state.CoreState`); `on_agent_event` dispatches by the
event's type. What a failure does to the attempt is `lifecycle.on_failure`.
"""

from __future__ import annotations

import logging
import signal
from typing import Any, Callable

from outlast.controller import commit_steps, ending, lifecycle, live_steps, on_workers, preempt_steps
from outlast.controller import states as st
from outlast.controller.commits import peer
from outlast.controller.core_state import CoreState
from outlast.controller.group import ForgetNode
from outlast.controller.preemption import Preemption
from outlast.controller.resize import Resize
from outlast.controller.states import Event, State
from outlast.controller.types import AttemptState
from outlast.protocol import messages as m
from outlast.protocol.kinds import FailureKind
from outlast.storage.records import DrainRecord, FailureRecord

log = logging.getLogger("outlast.controller")

_PREEMPTED = (State.PREEMPTING, State.SAVED)

# ---- agents ----------------------------------------------------------------------


def on_agent_event(c: CoreState, node_id: str, event: m.AgentEvent) -> None:
    handler = AGENT_EVENTS.get(type(event))
    if handler is not None:
        handler(c, node_id, event)


def _on_started(c: CoreState, node_id: str, event: m.WorkerStarted) -> None:
    a = c.attempt
    if a is not None and event.attempt == a.number and event.run_id == c.run_id:
        a.pids[event.rank] = event.pid
        c.book.note_output_file(event.rank, a.placement.get(event.rank, ""), event.output_file)


def _on_pong(c: CoreState, node_id: str, event: m.Pong) -> None:
    c.nodes.note_pid(node_id, event.pid)


def on_node_draining(c: CoreState, node_id: str, notice: m.NodeDraining) -> None:
    a, s, now = c.attempt, c.state, c.now
    nodes = set(notice.node_ids) | {notice.node_id}
    c.nodes.note_draining(notice)
    grace = c.plan.preemption_grace_s
    if isinstance(s, st.Preempting) and isinstance(s.preemption, Resize) and a is not None \
            and nodes & set(a.placement.values()):
        # A drain during a pending grow is a preemption of its own: the ranks hear of the drain (its nodes,
        # ranks and deadline) from now on, and a checkpoint saved for the grow answers it too.
        grow = s.preemption
        p = Preemption.begin(notice, a.placement, sorted(nodes & set(a.placement.values())),
                             grow.reports_at_notice, now, c.wall(), grace, exited=a.exited)
        p.jit_reports |= grow.jit_reports
        log.warning("node %s is draining (%s: %s) while the run was to grow; ranks %s of attempt %d are "
                    "preempted, and every rank has %.1f s to save a checkpoint", ", ".join(p.node_ids),
                    notice.reason, notice.message, p.ranks, a.number, p.deadline - now)
        c.state = st.Preempting(p)
        a.preemption = p
        return
    if isinstance(s, (st.Preempting, st.Saved)):
        added = s.preemption.widen(notice, a.placement, a.exited) if a is not None else []
        if added and a is not None:  # nodes are added only to an attempt's preemption
            log.warning("node%s %s of attempt %d %s draining too; ranks %s are preempted", "s"[:len(added) - 1],
                        ", ".join(added), a.number, "are" if len(added) > 1 else "is", s.preemption.ranks)
        left = s.preemption.tighten(notice, now, c.wall(), grace)
        if left is not None:
            log.warning("node %s is draining too, with an earlier deadline; the run has %.1f s",
                        notice.node_id, left)
        return
    if a is None or s.kind not in (State.SCHEDULING, State.RUNNING):
        return  # between attempts: the next placement avoids the draining nodes
    p = Preemption.begin(notice, a.placement, sorted(nodes & set(a.placement.values())),
                         c.commit_tracker.reports, now, c.wall(), grace, exited=a.exited)
    if not p.ranks:
        return
    if live_steps.on_drain(c, a, p):
        c.book.note_drain(DrainRecord(attempt=a.number, node_ids=list(p.node_ids), reason=notice.reason,
                                      message=notice.message, time=c.wall(), deadline=notice.deadline_unix_s,
                                      ranks=list(p.ranks)))
        for rank in a.exited:
            c.horizons.lose_rank(rank, now)
        preempt_steps.answer(c, c.horizons.preempt(now))  # told as always; the attempt goes on
        return
    p.through_peer, why = peer.decide(c.commit_view())
    log.info("the checkpoint saved for the drain %s: %s", "goes to a peer's memory first, then to storage"
             if p.through_peer else "is uploaded to storage by its ranks", why)
    ranks = p.ranks
    c.book.note_drain(DrainRecord(attempt=a.number, node_ids=list(p.node_ids), reason=notice.reason,
                                  message=notice.message, time=c.wall(), deadline=notice.deadline_unix_s,
                                  ranks=list(ranks)))
    log.warning("node %s is draining (%s: %s); ranks %s of attempt %d are preempted, and every rank has %.1f s "
                "to save a checkpoint", ", ".join(p.node_ids), notice.reason, notice.message, ranks,
                a.number, p.deadline - now)
    c.go(Event.PREEMPTION_NOTICE, st.Preempting(p))
    for rank in a.exited:  # a rank that already returned asks nothing more
        c.horizons.lose_rank(rank, now)
    preempt_steps.answer(c, c.horizons.preempt(now))


def on_spawn_refused(c: CoreState, node_id: str, refused: m.SpawnRefused) -> None:
    """A node turned the workers away (it began draining after we placed them): place again."""
    a = c.attempt
    if a is None or refused.attempt != a.number:
        return
    if c.state.kind is State.SCHEDULING:
        log.warning("attempt %d: %s; placing it again", a.number, refused.reason)
        lifecycle.on_failure(c, FailureRecord(attempt=a.number, rank=0, node_id="", pid=0, exit_code=None,
                                              signal=None, time=c.wall(), kind=FailureKind.SPAWN_REFUSED,
                                              message=refused.reason))
    # Those ranks never started, whatever the state by now; the other nodes' ranks report their exit.
    for rank in a.ranks_on({node_id}):
        a.exited.setdefault(rank, m.WorkerExited(run_id=c.run_id, attempt=a.number, rank=rank, pid=0,
                                                 exit_code=None, signal=None, error=None, node_id=node_id))
    lifecycle.judge_if_all_exited(c)


def check_nodes(c: CoreState, a: AttemptState, now: float) -> None:
    """A node lost with workers of this attempt: its ranks failed (or, preempted, are let go)."""
    live = {n for r, n in a.placement.items() if r not in a.exited}
    for node_id, why in c.nodes.lost_nodes(now, live).items():
        log.warning("%s; its ranks %s of attempt %d are lost", why, a.ranks_on({node_id}), a.number)
        c.nodes.lose(node_id, now)
        c.out.append(ForgetNode(node_id))
        for rank in a.ranks_on({node_id}):
            if rank in a.exited:
                continue
            on_worker_exited(c, m.WorkerExited(
                run_id=c.run_id, attempt=a.number, rank=rank, pid=a.pids.get(rank, 0), exit_code=None,
                signal=None, node_id=node_id,
                error=m.WorkerError(kind=FailureKind.NODE_LOST, message=why, traceback="", phase="train")))
            if c.closed or c.attempt is not a:
                return


def on_worker_exited(c: CoreState, ev: m.WorkerExited) -> None:
    a, s = c.attempt, c.state
    if a is None or ev.run_id != c.run_id or ev.attempt != a.number or ev.rank in a.exited:
        return
    if live_steps.retired(c, a, ev):
        if ev.rank in a.lost:  # a drained rank that left the group: nothing waits for it from here
            lose_shrunk_ranks(c, a, {ev.rank})
        for pending in live_steps.moved_out(c, ev.rank):
            commit_steps.begin(c, pending)
        # The last process to exit may be a drained one that left the group: the others returned already.
        _after_exit(c, a)
        return
    a.exited[ev.rank] = ev
    failed = ev.exit_code != 0 or ev.error is not None
    if not failed:
        commit_steps.check_uploads_of(c, a, ev.rank)
        live_steps.on_clean_exit(c, a, ev.rank)
    p = preempt_steps.preemption(c)
    if s.kind in _PREEMPTED and c.plan.relax_collectives and p is not None and ev.rank in p.ranks:
        lose_preempted_rank(c, a, p, ev, failed)
    elif failed and not (s.kind is State.RESTARTING and _our_stop(c, a, ev)):
        record = _failure_record(ev, c.wall())
        lost_before = set(a.lost)
        if live_steps.on_death(c, a, ev.rank, record):
            if a.lost - lost_before:
                lose_shrunk_ranks(c, a, a.lost - lost_before)
                return
            # The survivors go on, and a replacement takes the rank. The committed steps the dead rank had not
            # reported it never will, nor will its uploads say they are done: the checkpoints waiting on it settle
            # without it (CommitTracker.replaced, lose_uploads).
            for pending in [*c.commit_tracker.lose_uploads(ev.rank), *c.commit_tracker.replaced(ev.rank)]:
                commit_steps.begin(c, pending)
            return
        lifecycle.on_failure(c, record)
    elif s.kind in _PREEMPTED:
        # The others go on saving; if every rank returns, the training is over and the run finishes.
        log.warning("rank %d returned from the train function during a preemption", ev.rank)
        preempt_steps.answer(c, c.horizons.lose_rank(ev.rank, c.now))
    _after_exit(c, a)


def _after_exit(c: CoreState, a: AttemptState) -> None:
    """A process of the attempt exited: the attempt may be over."""
    if c.attempt is not a:
        return
    if c.state.kind is State.RESTARTING:
        lifecycle.judge_if_all_exited(c)
    elif c.state.kind.has_live_workers and a.all_exited(c.plan.world_size):
        if ending.settled(c, a):
            ending.finish(c)
        else:
            c.go(Event.ALL_EXITED, st.Finishing(since=c.now))
    elif c.state.kind.is_terminal:
        ending.close_if_stopped(c, c.now)


def _our_stop(c: CoreState, a: AttemptState, ev: m.WorkerExited) -> bool:
    """A death by a signal alone that our stop explains: SIGTERM; SIGKILL once its grace is over, or of a rank
    whose start its agent never told (born after the stop, the agent kills it at once). A SIGKILL of a started
    rank before the grace is over is someone else's (a kill -9, the kernel), and a failure of its own."""
    if ev.error is not None or ev.signal is None:
        return False
    if ev.signal != signal.SIGKILL or ev.rank not in a.pids:
        return True
    return a.stopped_at is not None and c.now >= a.stopped_at + c.plan.timeouts.teardown_grace_s


def lose_preempted_rank(c: CoreState, a: AttemptState, p: Preemption, ev: m.WorkerExited,
                         failed: bool) -> None:
    """Relaxed collectives: the survivors go on without a rank of a preempted node."""
    a.lost.add(ev.rank)
    if failed:
        a.failures.append(_failure_record(ev, c.wall()))
    log.warning("rank %d (on preempted node %s) is gone; ranks %s go on without it", ev.rank, ev.node_id,
                sorted(set(range(c.plan.world_size)) - a.lost))
    preempt_steps.answer(c, c.horizons.lose_rank(ev.rank, c.now))
    outcome = c.commit_tracker.lose_ranks({ev.rank})
    for pending in outcome.settled:
        commit_steps.begin(c, pending)
        if c.state.kind not in _PREEMPTED:
            return
    for done in c.collectives.lose_ranks({ev.rank}):
        on_workers.reply_collective(c, done)
    if a.all_exited(c.plan.world_size) and c.state.kind in _PREEMPTED:
        lifecycle.restart(c, Event.PREEMPTION_SAFE, p)


def lose_shrunk_ranks(c: CoreState, a: AttemptState, ranks: set[int]) -> None:
    """Live recovery shrank the group without `ranks` (a lost node's, or a drained one's that left): no checkpoint,
    collective or preemption answer waits for them from here; a checkpoint they held a shard of and never reported
    is missing it."""
    for rank in sorted(ranks):
        preempt_steps.answer(c, c.horizons.lose_rank(rank, c.now))
    live = c.live
    assert live is not None
    for rank in sorted(ranks):
        for pending in c.commit_tracker.lose_ranks({rank}, left_from=live.left_in[rank]).settled:
            commit_steps.begin(c, pending)
    for done in c.collectives.lose_ranks(ranks):
        on_workers.reply_collective(c, done)


def _failure_record(ev: m.WorkerExited, wall: float) -> FailureRecord:
    err = ev.error
    return FailureRecord(
        attempt=ev.attempt, rank=ev.rank, node_id=ev.node_id, pid=ev.pid, exit_code=ev.exit_code,
        signal=ev.signal, time=wall,
        exc_type=err.exc_type if err else None, kind=err.kind if err else None, message=err.message if err else None,
        traceback=err.traceback if err else None, phase=err.phase if err else None,
        oom_report=ev.oom_report,
    )


AGENT_EVENTS: dict[type, Callable[[CoreState, str, Any], None]] = {
    m.WorkerExited: lambda c, node_id, ev: on_worker_exited(c, ev), m.WorkerStarted: _on_started,
    m.NodeDraining: on_node_draining, m.SpawnRefused: on_spawn_refused, m.Pong: _on_pong,
}
