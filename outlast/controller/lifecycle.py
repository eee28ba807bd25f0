"""An attempt's life in the controller's core: placing it, what it restores, restarting it, and what a failure
or a commit does to it. How the run ends (giving up, finishing, closing) is `ending.py`.

Plain functions over the core's state (`core_state.CoreState`); the state changes they make
follow the table in `states.py`, and the decisions are `policy.py`'s, `attempt_verdict.py`'s, `resize.py`'s
and `preemption.py`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import signal

from outlast.controller import effects as fx
from outlast.controller import ending, live_steps, memory_restore, resize, spawns
from outlast.controller import states as st
from outlast.controller.attempt_verdict import (AddFailure, AttemptFacts, AttemptVerdict, EndAttempt, FailAttempt,
                                               HistoryNote, SkipRestored, judge_attempt)
from outlast.controller.commit import CommitTracker, PendingCheckpoint
from outlast.controller.core_state import CoreState
from outlast.controller.group import Effect, QueryTable, ToNode
from outlast.controller.heartbeat import heartbeat
from outlast.controller.horizons import HorizonBook
from outlast.controller.placement import NoCapacity
from outlast.controller.policy import caused_by_drain
from outlast.controller.preempt_steps import answer, jit_uploads, preemption, room_elsewhere
from outlast.controller.preemption import Preemption
from outlast.controller.runstate import RunBook
from outlast.controller.states import Event
from outlast.controller.types import AttemptState
from outlast.protocol.kinds import FailureKind
from outlast.protocol import messages as m
from outlast.storage.records import FailureRecord

log = logging.getLogger("outlast.controller")

TABLE_WAIT_S = 1.0  # how long a new attempt waits for a fresh node table before placing on the last one
CAPACITY_RETRY_S = 1.0


def enter_placing(c: CoreState, now: float) -> None:
    """A new attempt: its place in the history now; what it restores once storage has said (`restore_read`)."""
    number = c.book.begin_attempt(c.wall())
    ending.remove_uncommitted(c, from_attempt=number)
    c.attempt = AttemptState(number=number, started_at=now)
    c.commit_tracker = CommitTracker(c.plan.world_size)
    c.collectives = c.new_collectives()
    c.horizons = HorizonBook()
    c.uploads.clear()
    if not memory_restore.read_restorable(c, c.attempt):
        restore_read(c, c.attempt, None, None)


def on_manifests_read(c: CoreState, done: fx.ManifestsRead) -> None:
    """Storage read the manifests of what the attempt may restore (`memory_restore.read_restorable`)."""
    asked = c.restore_reads.pop(done.id)
    a = asked.attempt
    if c.attempt is not a:
        return
    if c.book.state.latest_checkpoint != asked.asked:  # a commit landed meanwhile: read again
        if not memory_restore.read_restorable(c, a):
            restore_read(c, a, None, None)
        return
    for read in done.reads:
        if read.newer is not None:
            ending.give_up(c, read.newer)
            return
        if read.ranks is not None:
            restore_read(c, a, read.checkpoint_dir, set(read.ranks))
            return
        if read.unreadable is not None:
            # Not skipped: storage may be failing for now. Its workers fail and retry if it still is.
            log.warning("could not read the manifest of checkpoint %s (%s); restoring it all the same",
                        read.checkpoint_dir, read.unreadable)
            restore_read(c, a, read.checkpoint_dir, None)
            return
        fallback = c.book.skip_checkpoint(read.checkpoint_dir, read.skip or "unreadable", c.wall())
        log.warning("checkpoint %s cannot be restored (%s); using %s instead", read.checkpoint_dir, read.skip,
                    fallback or "no checkpoint")
    restore_read(c, a, None, None)


def restore_read(c: CoreState, a: AttemptState, restore: str | None, holders: set[int] | None) -> None:
    """Storage said what the attempt restores: place it."""
    if c.attempt is not a or not isinstance(c.state, st.Placing):
        return
    a.restore, a.restore_ranks, a.prepared = restore, holders, True
    c.commit_tracker = CommitTracker(c.plan.world_size, shard_holders=holders)
    if c.book.state.attempts:
        c.book.state.attempts[-1].restored_from = restore
    if a.number > 1 or restore:
        log.info("starting attempt %d of run %s%s", a.number, c.plan.name,
                 f", restoring {restore}" if restore else " from scratch")
    if a.number > 1:  # place on what the head knows now, if it answers within a second
        c.out.append(QueryTable())
    else:
        place(c, c.now)


def place(c: CoreState, now: float) -> None:
    """Place every rank on a node that is alive and not draining, or wait for one (bounded)."""
    a, s = c.attempt, c.state
    assert a is not None
    if not a.prepared:
        return  # storage has not said yet what the attempt restores
    placed = c.resizes.place(c.nodes.views(c.run_id, now), c.plan.world_size, c.plan.per_worker, c.plan.strategy)
    if isinstance(placed, NoCapacity):
        c.out.append(QueryTable())
        if (gone := c.nodes.head_lost(now)) is not None:
            # No node can join a cluster without its head: waiting for capacity would wait for nothing.
            why = f"{gone}. Attempt {a.number} cannot be placed: {placed.reason}"
            ending.give_up(c, ending.head_lost_error(c, a.number, why))
            return
        if isinstance(s, st.WaitingForCapacity):
            if now - s.since > c.plan.timeouts.capacity_s:
                ending.give_up(c, f"no capacity for attempt {a.number} within {c.plan.timeouts.capacity_s:.0f} s:"
                           f" {placed.reason}. Add a node (outlast start --address HEAD) or raise "
                           "OUTLAST_CAPACITY_TIMEOUT_S")
                return
            c.state = st.WaitingForCapacity(s.since, placed.reason, now + CAPACITY_RETRY_S)
            return
        log.warning("attempt %d is waiting for capacity: %s (nodes: %s); retrying for at most %.0f s "
                    "(OUTLAST_CAPACITY_TIMEOUT_S)", a.number, placed.reason, c.nodes.describe(),
                    c.plan.timeouts.capacity_s)
        c.book.set_waiting(placed.reason, c.wall())
        c.go(Event.NO_CAPACITY, st.WaitingForCapacity(now, placed.reason, now + CAPACITY_RETRY_S))
        return
    if isinstance(s, st.WaitingForCapacity):
        log.info("attempt %d found capacity after %.1f s", a.number, now - s.since)
        c.book.set_waiting(None, c.wall())
    a.started_at = now
    a.placement = {spec.rank: node.node_id for node, spec in placed.workers}
    size_attempt(c, a, len(placed.workers), now)
    c.go(Event.PLACED, st.Scheduling(since=now))
    by_node: dict[str, list[m.WorkerSpec]] = {}
    for node, spec in placed.workers:
        by_node.setdefault(node.node_id, []).append(spec)
    env = dict(c.plan.env)
    if c.plan.rendezvous:  # torch.distributed meets at rank 0's node
        env["MASTER_ADDR"] = c.nodes.nodes[a.placement[0]].host
    if c.plan.relax_collectives:
        env["OUTLAST_RELAX_COLLECTIVES"] = "1"
    if c.plan.live_store:
        env.update(live_steps.begin(c, a, len(placed.workers)))
    a.env = env
    a.specs = {spec.rank: spec for _, spec in placed.workers}
    if len(by_node) > 1:
        log.info("attempt %d: ranks placed on %s", a.number,
                 ", ".join(f"{n} {[s.rank for s in specs]}" for n, specs in by_node.items()))
    sends: list[Effect] = []
    for node_id, specs in by_node.items():
        if c.nodes.link(node_id, now):
            sends.append(ToNode(node_id, heartbeat(c)))  # the agent knows the run before its workers
        sends.append(spawns.spawn(c, a, node_id, specs, env))
    memory_restore.pull_then(c, a, sends)



def restart(c: CoreState, event: Event, preemption: Preemption | None) -> None:
    """The attempt is over (failed, or preempted): stop its workers; judge it once all have exited."""
    c.go(event, st.Restarting(preemption))
    ending.stop_workers(c)
    judge_if_all_exited(c)


def judge_if_all_exited(c: CoreState) -> None:
    a, s = c.attempt, c.state
    if not isinstance(s, st.Restarting) or a is None or not a.all_exited(c.plan.world_size):
        return
    p = c.plan
    preemption = s.preemption
    # Its teardown counts too: a rank that the stop could not end (stuck in the kernel), or killed by someone
    # else before the stop's grace was over, has a cause of its own, even once the drain's checkpoint is committed.
    own = a.failed or any(f.kind is FailureKind.UNKILLABLE or (f.signal == signal.SIGKILL and f.named is None)
                          for f in a.failures)
    if preemption is not None and own and not caused_by_drain(a.failures, {*preemption.node_ids}):
        log.warning("attempt %d failed while it saved for the drain of %s, for a cause of its own: charged to "
                    "max_failures", a.number, ", ".join(preemption.node_ids) or preemption.notice.node_id)
        preemption = None
    preemption = preemption or preempted_by_drain(c, a)
    verdict = c.resizes.end_if_resized(c.book, a.number, p.world_size, a.failures, preemption,
                                       c.commit_tracker.reports) \
        or judge_attempt(AttemptFacts.of(c.book, a.number), a.number, a.failures, c.failures,
                         resize.for_judging(preemption), p.max_failures, p.max_preemption_failures, a.hello, a.set_up)
    write_verdict(c.book, verdict, c.wall())
    c.failures += verdict.blamed
    if verdict.retry:
        c.go(Event.RETRY, st.Placing(place_by=None))
        enter_placing(c, c.now)
        return
    assert verdict.error is not None  # a verdict that does not retry always carries its error
    c.error = verdict.error
    c.go(Event.GIVE_UP, st.Errored(error=verdict.error, stop_by=c.now))
    ending.close_if_stopped(c, c.now)


def write_verdict(book: RunBook, verdict: AttemptVerdict, wall: float) -> None:
    """Write an attempt's verdict to the run's history, in the order the verdict gives its changes."""
    for change in verdict.changes:
        if isinstance(change, FailAttempt):
            book.fail_attempt(change.root, change.budget, wall)
        elif isinstance(change, AddFailure):
            book.add_failure(change.record)
        elif isinstance(change, SkipRestored):
            fallback = book.skip_checkpoint(change.checkpoint_dir, change.reason, wall)
            log.warning("%s; restarting from %s instead (not counted against max_failures)", change.reason,
                        fallback or "scratch")
        elif isinstance(change, HistoryNote):
            book.note_once(change.text, wall)
        elif isinstance(change, EndAttempt):
            book.end_attempt(change.outcome, wall)


def preempted_by_drain(c: CoreState, a: AttemptState) -> Preemption | None:
    """An attempt that failed because a drained node went away (a deadline of 0 s, or a notice that came
    after the failure it caused) was preempted: it draws on the preemption budget, not max_failures.
    Only when every failure is on a drained node or a symptom of one: a cause elsewhere is not the drain's."""
    drained = {n: d for n in sorted(set(a.placement.values())) if (d := c.nodes.drain_of(n)) is not None}
    if not drained or not a.failures:
        return None
    if not caused_by_drain(a.failures, set(drained)):
        return None
    notice = next(iter(drained.values()))
    return Preemption.begin(notice, a.placement, sorted(drained), c.commit_tracker.reports, c.now, c.wall(),
                            c.plan.preemption_grace_s)


def on_timers(c: CoreState, a: AttemptState, now: float) -> None:
    """What the states wait for, with a deadline."""
    t, s = c.plan.timeouts, c.state
    if isinstance(s, st.Running):  # the state of almost every step, which waits for nothing here
        return
    if isinstance(s, st.Placing) and s.place_by is not None and now >= s.place_by:
        place(c, now)
    elif isinstance(s, st.WaitingForCapacity) and now >= s.retry_at:
        place(c, now)
    elif isinstance(s, st.Scheduling) and now - s.since > t.worker_start_s:
        missing = sorted(set(range(c.plan.world_size)) - a.hello)
        ending.give_up(c, f"ranks {missing} of attempt {a.number} did not start within {t.worker_start_s:.0f} s "
                          "(OUTLAST_WORKER_START_TIMEOUT_S); is a node's fork server stuck? `outlast status` "
                          "and the nodes' logs tell")
    elif isinstance(s, (st.Preempting, st.Saved)):
        saved = s.checkpoint if isinstance(s, st.Saved) else None
        verdict = s.preemption.decide(now, saved, saved is not None and room_elsewhere(c, now),
                                      jit_uploads(c, s.preemption, now))
        if verdict.restart_now:
            log.warning("attempt %d: %s; restarting from %s now", a.number, verdict.reason,
                        c.book.state.latest_checkpoint or "scratch")
            restart(c, Event.PREEMPTION_SAFE, s.preemption)
    elif isinstance(s, st.Finishing) and now - s.since > t.last_messages_s and not c.commits.checking_uploads \
            and not c.commits.uploading_from_memory:  # a drain's checkpoint still going from a peer's memory
        ending.finish_without_last_messages(c, a)


# ---- elastic runs (resize.py decides) -------------------------------------------------


def size_attempt(c: CoreState, a: AttemptState, workers: int, now: float) -> None:
    """An elastic attempt's world is what was placed: the trackers count its ranks, not the last one's."""
    if workers != c.plan.world_size:
        c.plan = dataclasses.replace(c.plan, world_size=workers)
        holders = a.restore_ranks
        c.commit_tracker = CommitTracker(workers, shard_holders=None if holders is None else
                                         {r for r in holders if r < workers})
        c.collectives = c.new_collectives()
    record = c.resizes.placed(c.book, a.number, workers, now, c.wall())
    if record is not None:
        log.warning("attempt %d runs on %d workers, was %d: %s (%d steps lost)", a.number, record.to_workers,
                    record.from_workers, record.reason, record.steps_lost)


def consider_grow(c: CoreState, now: float) -> None:
    a = c.attempt
    # A live shrink's lost ranks are out of the attempt: the run trains on without them, and may grow back.
    lost = a.lost if a is not None and c.live is not None else set()
    workers = c.plan.world_size - len(lost)
    # Every node table comes here while the run trains: one that cannot grow builds no views of the nodes.
    if a is None or set(a.exited) - lost or not c.resizes.may_grow(workers):
        return
    grow = c.resizes.consider_grow(c.nodes.views(c.run_id, now), workers, c.plan.per_worker, c.plan.strategy, now)
    if grow.to_workers is None:
        return
    if live_steps.on_grow(c, a, grow.to_workers, grow.reason):
        return  # the added ranks take the state from the running ones: no notice, no checkpoint, no restart
    if lost:
        return  # the notice's grow counts the attempt's ranks from 0: a shrunk one grows live, or at its restart
    p = resize.grow_notice(grow, c.plan.world_size, c.commit_tracker.reports, now, c.wall())
    log.warning("attempt %d: %s; the loop is told to save a checkpoint (get_preemption_info().reason == %r)",
                a.number, p.notice.message, resize.RESIZE)
    c.go(Event.PREEMPTION_NOTICE, st.Preempting(p))
    answer(c, c.horizons.preempt(now))


# ---- what a failure, and a commit, do to the attempt ---------------------------------------


def on_failure(c: CoreState, record: FailureRecord) -> None:
    """The first failure ends the attempt; the cause is judged once every worker has exited."""
    assert c.attempt is not None
    c.attempt.failures.append(record)
    # The first failure is written at once; the rest (often every rank's exit in the teardown)
    # with the attempt's verdict, not one run-state write each.
    c.book.add_failure(record, save=c.state.kind.has_live_workers)
    if c.state.kind.has_live_workers:
        c.attempt.failed = True
        restart(c, Event.WORKER_FAILED, preemption(c))


def decide_on_commit(c: CoreState, pending: PendingCheckpoint) -> bool:
    """A checkpoint of the attempt is committed. If it is the one the loop saved for a preemption, the preemption
    decides (`Preemption.decide`): restart now, or train on `Saved` with nowhere to go. True: its ranks hear it now;
    False: they stay blocked in that report() until the teardown reaches them."""
    s = c.state
    if not (isinstance(s, st.Preempting) and s.preemption.saved_by(pending.index, pending.files, c.horizons.watched)):
        return True
    verdict = s.preemption.decide(c.now, pending.checkpoint_dir, room_elsewhere(c, c.now))
    if verdict.restart_now:
        # The ranks stay blocked in that report() until the teardown reaches them: a step
        # they took after it would be lost.
        log.info("%s; restarting now", verdict.reason)
        restart(c, Event.PREEMPTION_SAFE, s.preemption)
        return False
    log.warning("%s", verdict.reason)
    c.go(Event.SAVED_NOWHERE_TO_GO, st.Saved(s.preemption, pending.checkpoint_dir))
    if s.preemption.notice.until_commit:
        # Its nodes go away now that it is committed (a Slurm job is requeued): nothing the loop
        # does from here is kept, so the ranks that wait for it wait until the teardown.
        log.info("checkpoint %s is the last this attempt commits (the drain ends with it); its ranks wait in "
                 "report() until the run stops", pending.checkpoint_dir)
        return False
    return True
