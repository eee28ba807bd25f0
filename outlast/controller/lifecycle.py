"""An attempt's life in the controller's core: placing it, restarting it, settling it, closing the run.

Plain functions over the core's state (`core.ControllerCore`); the state changes they make
follow the table in `states.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from typing import TYPE_CHECKING

from outlast.controller import checkpoints, memory_holds, memory_restore, resize
from outlast.controller import states as st
from outlast.controller.commit import CommitTracker
from outlast.controller.group import QueryTable, Spawn, StopRun, ToNode
from outlast.controller.horizons import Answer, HorizonBook, NoticeAt
from outlast.controller.placement import NoCapacity
from outlast.controller.policy import caused_by_drain
from outlast.controller.preemption import Preemption
from outlast.controller.attempt_verdict import judge_attempt
from outlast.controller.states import Event, State
from outlast.controller.types import AttemptState
from outlast.errors import TrainingFailedError
from outlast.protocol.kinds import FailureKind
from outlast.protocol import messages as m

if TYPE_CHECKING:
    from outlast.controller.core import ControllerCore

log = logging.getLogger("outlast.controller")

TABLE_WAIT_S = 1.0  # how long a new attempt waits for a fresh node table before placing on the last one
CAPACITY_RETRY_S = 1.0
TEARDOWN_EXTRA_S = 5.0


def go(c: "ControllerCore", event: Event, new: st.AnyState) -> None:
    """Move to `new`, which must be the state the table gives for this event."""
    expected = st.transition(c.state.kind, event)
    if expected is not new.kind:
        raise st.InvalidTransition(f"{c.state.kind.value} on {event.value} leads to {expected.value}, "
                                   f"not {new.kind.value}")
    log.debug("%s --%s--> %s", c.state.kind.value, event.value, new.kind.value)
    c.state = new
    p = getattr(new, "preemption", None)
    if p is not None and c.attempt is not None:
        c.attempt.preemption = p


def enter_placing(c: "ControllerCore", now: float) -> None:
    """A new attempt: its place in the history now; what it restores once storage has said (`restore_read`)."""
    from outlast.controller.core import new_collectives

    number = c.book.begin_attempt(c.wall())
    checkpoints.remove_uncommitted(c, from_attempt=number)
    c.attempt = AttemptState(number=number, started_at=now)
    c.commits = CommitTracker(c.plan.world_size)
    c.collectives = new_collectives(c)
    c.horizons = HorizonBook()
    c.uploads.clear()
    checkpoints.read_restorable(c, c.attempt)


def restore_read(c: "ControllerCore", a: AttemptState, restore: str | None, holders: set[int] | None) -> None:
    """Storage said what the attempt restores: place it."""
    if c.attempt is not a or not isinstance(c.state, st.Placing):
        return
    a.restore, a.restore_ranks, a.prepared = restore, holders, True
    c.commits = CommitTracker(c.plan.world_size, shard_holders=holders)
    if c.book.state.attempts:
        c.book.state.attempts[-1].restored_from = restore
    if a.number > 1 or restore:
        log.info("starting attempt %d of run %s%s", a.number, c.plan.name,
                 f", restoring {restore}" if restore else " from scratch")
    if a.number > 1:  # place on what the head knows now, if it answers within a second
        c.out.append(QueryTable())
    else:
        place(c, c.now)


def place(c: "ControllerCore", now: float) -> None:
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
            give_up(c, head_lost_error(c, a.number, f"{gone}. Attempt {a.number} cannot be placed: {placed.reason}"))
            return
        if isinstance(s, st.WaitingForCapacity):
            if now - s.since > c.plan.timeouts.capacity_s:
                give_up(c, f"no capacity for attempt {a.number} within {c.plan.timeouts.capacity_s:.0f} s:"
                           f" {placed.reason}. Add a node (outlast start --address HEAD) or raise "
                           "OUTLAST_CAPACITY_TIMEOUT_S")
                return
            c.state = st.WaitingForCapacity(s.since, placed.reason, now + CAPACITY_RETRY_S)
            return
        log.warning("attempt %d is waiting for capacity: %s (nodes: %s); retrying for at most %.0f s "
                    "(OUTLAST_CAPACITY_TIMEOUT_S)", a.number, placed.reason, c.nodes.describe(),
                    c.plan.timeouts.capacity_s)
        c.book.set_waiting(placed.reason, c.wall())
        go(c, Event.NO_CAPACITY, st.WaitingForCapacity(now, placed.reason, now + CAPACITY_RETRY_S))
        return
    if isinstance(s, st.WaitingForCapacity):
        log.info("attempt %d found capacity after %.1f s", a.number, now - s.since)
        c.book.set_waiting(None, c.wall())
    a.started_at = now
    a.placement = {spec.rank: node.node_id for node, spec in placed.workers}
    size_attempt(c, a, len(placed.workers), now)
    go(c, Event.PLACED, st.Scheduling(since=now))
    by_node: dict[str, list[m.WorkerSpec]] = {}
    for node, spec in placed.workers:
        by_node.setdefault(node.node_id, []).append(spec)
    env = dict(c.plan.env)
    if c.plan.rendezvous:  # torch.distributed meets at rank 0's node
        env["MASTER_ADDR"] = c.nodes.nodes[a.placement[0]].host
    if c.plan.relax_collectives:
        env["OUTLAST_RELAX_COLLECTIVES"] = "1"
    if len(by_node) > 1:
        log.info("attempt %d: ranks placed on %s", a.number,
                 ", ".join(f"{n} {[s.rank for s in specs]}" for n, specs in by_node.items()))
    sends: list = []
    for node_id, specs in by_node.items():
        if c.nodes.link(node_id, now):
            sends.append(ToNode(node_id, heartbeat(c)))  # the agent knows the run before its workers
        sends.append(Spawn(node_id, m.SpawnWorkers(
            run_id=c.run_id, attempt=a.number, controller_address=c.address, workers=specs,
            payload=c.plan.payload, env=env, cwd=c.plan.cwd, sys_path=c.plan.sys_path,
            run_name=c.plan.name, restore_checkpoint=a.restore, resources=c.plan.per_worker,
            run_key=c.book.store.storage.uri(c.book.store.run_dir), forward_output=c.plan.forward_output,
            agent_pid=c.nodes.nodes[node_id].agent_pid,
        )))
    memory_restore.pull_then(c, a, sends)


def restart(c: "ControllerCore", event: Event, preemption: Preemption | None) -> None:
    """The attempt is over (failed, or preempted): stop its workers; judge it once all have exited."""
    go(c, event, st.Restarting(preemption))
    stop_workers(c)
    judge_if_all_exited(c)


def judge_if_all_exited(c: "ControllerCore") -> None:
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
    verdict = c.resizes.end_if_resized(c.book, a.number, p.world_size, a.failures, preemption, c.commits.reports,
                                       c.wall()) \
        or judge_attempt(c.book, a.number, a.failures, c.failures, resize.for_judging(preemption),
                          p.max_failures, p.max_preemption_failures, c.wall(), a.hello, a.set_up)
    if verdict.retry:
        go(c, Event.RETRY, st.Placing(place_by=None))
        enter_placing(c, c.now)
        return
    c.error = verdict.error
    go(c, Event.GIVE_UP, st.Errored(error=verdict.error, stop_by=c.now))
    close_if_stopped(c, c.now)


def head_lost_error(c: "ControllerCore", attempt: int, why: str) -> str:
    latest = c.book.state.latest_checkpoint
    return (f"{why}. The run stops here, with attempt {attempt}; its latest committed checkpoint stays "
            f"{latest or 'none'}. Start the head again (`outlast start` on its machine, with the same "
            "--port and cluster key) and run fit() again with the same RunConfig(name, storage_path) to go on "
            "from there. A cluster whose nodes keep its state in etcd (`outlast start --etcd URL,...`, "
            "docs/operations/etcd.md) has no single head to lose")


def preempted_by_drain(c: "ControllerCore", a: AttemptState) -> Preemption | None:
    """An attempt that failed because a drained node went away (a deadline of 0 s, or a notice that came
    after the failure it caused) was preempted: it draws on the preemption budget, not max_failures.
    Only when every failure is on a drained node or a symptom of one: a cause elsewhere is not the drain's."""
    drained = {n: d for n in sorted(set(a.placement.values())) if (d := c.nodes.drain_of(n)) is not None}
    if not drained or not a.failures:
        return None
    if not caused_by_drain(a.failures, set(drained)):
        return None
    notice = next(iter(drained.values()))
    return Preemption.begin(notice, a.placement, sorted(drained), c.commits.reports, c.now, c.wall(),
                            c.plan.preemption_grace_s)


def give_up(c: "ControllerCore", reason: str) -> None:
    c.error = TrainingFailedError(f"training failed: {reason}", list(c.failures))
    log.error("%s", reason)
    go(c, Event.UNRECOVERABLE, st.Errored(error=c.error, stop_by=stop_by(c, c.now)))
    stop_workers(c)
    close_if_stopped(c, c.now)


def finish(c: "ControllerCore") -> None:
    go(c, Event.ALL_FINISHED, st.Finished())
    close_if_stopped(c, c.now)


def stop_by(c: "ControllerCore", now: float) -> float:
    return now + c.plan.timeouts.teardown_grace_s + TEARDOWN_EXTRA_S


def stop_workers(c: "ControllerCore") -> None:
    a = c.attempt
    if a is None:
        return
    answer(c, c.horizons.release())  # no rank waits on a decision while it is stopped
    if a.stopped_at is None:
        a.stopped_at = c.now
    stop = m.StopWorkers(run_id=c.run_id, attempt=a.number, grace_s=c.plan.timeouts.teardown_grace_s)
    for node_id in sorted(set(a.placement.values())):
        if node_id in c.nodes.heard:
            c.out.append(StopRun(node_id, stop))


def close_if_stopped(c: "ControllerCore", now: float) -> None:
    """A terminal state closes the run once its workers are gone, or the wait for them is over; the run
    is `closed` once storage has answered what it was given."""
    s, a = c.state, c.attempt
    if c.closing:
        return
    if isinstance(s, (st.Errored, st.Aborted)) and a is not None and now < s.stop_by:
        expected = {r for r, n in a.placement.items() if n in c.nodes.heard}
        if not expected <= set(a.exited):
            return
    checkpoints.remove_uncommitted(c)
    outcome = {State.FINISHED: "finished", State.ERRORED: "failed", State.ABORTED: "aborted"}[s.kind]
    c.book.end_attempt(outcome, c.wall())
    c.book.finish(s.kind.value, error=str(c.error) if isinstance(s, st.Errored) else None,
                  last_metrics=c.last_metrics)
    c.out += [ToNode(n, m.EndRun(run_id=c.run_id)) for n in sorted(c.nodes.heard)]
    memory_holds.free_at_end(c)
    c.closing = True


def on_timers(c: "ControllerCore", a: AttemptState, now: float) -> None:
    """What the states wait for, with a deadline."""
    from outlast.controller import peer_uploads

    peer_uploads.on_timers(c)
    t, s = c.plan.timeouts, c.state
    if isinstance(s, st.Placing) and s.place_by is not None and now >= s.place_by:
        place(c, now)
    elif isinstance(s, st.WaitingForCapacity) and now >= s.retry_at:
        place(c, now)
    elif isinstance(s, st.Scheduling) and now - s.since > t.worker_start_s:
        missing = sorted(set(range(c.plan.world_size)) - a.hello)
        give_up(c, f"ranks {missing} of attempt {a.number} did not start within {t.worker_start_s:.0f} s "
                   "(OUTLAST_WORKER_START_TIMEOUT_S); is a node's fork server stuck? `outlast status` "
                   "and the nodes' logs tell")
    elif isinstance(s, (st.Preempting, st.Saved)):
        from outlast.controller.handlers import jit_uploads

        saved = s.checkpoint if isinstance(s, st.Saved) else None
        verdict = s.preemption.decide(now, saved, saved is not None and room_elsewhere(c, now),
                                      jit_uploads(c, s.preemption, now))
        if verdict.restart_now:
            log.warning("attempt %d: %s; restarting from %s now", a.number, verdict.reason,
                        c.book.state.latest_checkpoint or "scratch")
            restart(c, Event.PREEMPTION_SAFE, s.preemption)
    elif isinstance(s, st.Finishing) and now - s.since > t.last_messages_s and not c.checking_uploads \
            and not c.durable:  # a drain's checkpoint still going from a peer's memory to storage
        checkpoints.finish_without_last_messages(c, a)


def heartbeat(c: "ControllerCore") -> m.RunHeartbeat:
    return m.RunHeartbeat(run_id=c.run_id, timeout_s=c.plan.timeouts.driver_lost_after_s,
                          last_commit_at=last_commit_this_attempt(c), saved_for_drain_at=saved_for_drain_at(c))


def saved_for_drain_at(c: "ControllerCore") -> float | None:
    """When the checkpoint the loop saved for the drain it is in was committed: it is `Saved` with nowhere to go
    (a run that found room elsewhere restarts there at once)."""
    s = c.state
    record = memory_holds.record_of(c, s.checkpoint) if isinstance(s, st.Saved) else None
    return record.committed_at if record is not None else None


def last_commit_this_attempt(c: "ControllerCore") -> float | None:
    """What a kill would throw away starts here (None: the attempt's start, as the agent knows it)."""
    a, latest = c.attempt, c.book.state.checkpoints[-1:]
    if a is None or not latest or latest[0].attempt != a.number:
        return None
    return latest[0].committed_at


def room_elsewhere(c: "ControllerCore", now: float) -> bool:
    return c.resizes.room_elsewhere(c.nodes.views(c.run_id, now), c.plan.world_size, c.plan.per_worker,
                                    c.plan.strategy)


# ---- elastic runs (resize.py decides) -------------------------------------------------


def size_attempt(c: "ControllerCore", a: AttemptState, workers: int, now: float) -> None:
    """An elastic attempt's world is what was placed: the trackers count its ranks, not the last one's."""
    from outlast.controller.core import new_collectives

    if workers != c.plan.world_size:
        c.plan = dataclasses.replace(c.plan, world_size=workers)
        holders = a.restore_ranks
        c.commits = CommitTracker(workers, shard_holders=None if holders is None else
                                  {r for r in holders if r < workers})
        c.collectives = new_collectives(c)
    record = c.resizes.placed(c.book, a.number, workers, now, c.wall())
    if record is not None:
        log.warning("attempt %d runs on %d workers, was %d: %s (%d steps lost)", a.number, record.to_workers,
                    record.from_workers, record.reason, record.steps_lost)


def consider_grow(c: "ControllerCore", now: float) -> None:
    a = c.attempt
    grow = c.resizes.consider_grow(c.nodes.views(c.run_id, now), c.plan.world_size, c.plan.per_worker,
                                   c.plan.strategy, now)
    if a is None or grow.to_workers is None or a.exited:
        return
    p = resize.grow_notice(grow, c.plan.world_size, c.commits.reports, now, c.wall())
    log.warning("attempt %d: %s; the loop is told to save a checkpoint (get_preemption_info().reason == %r)",
                a.number, p.notice.message, resize.RESIZE)
    go(c, Event.PREEMPTION_NOTICE, st.Preempting(p))
    answer(c, c.horizons.preempt(now))


def preemption(c: "ControllerCore") -> Preemption | None:
    return getattr(c.state, "preemption", None)


def answer(c: "ControllerCore", answers: list[Answer]) -> None:
    a = c.attempt
    p = preemption(c) or (a.preemption if a is not None else None)
    for ans in answers:
        if isinstance(ans.reply, NoticeAt):
            # A decision is only ever fixed after a notice, and the attempt keeps its preemption.
            assert p is not None and a is not None, "a preemption decision without a preemption"
            msg: m.Msg = p.notice_message(ans.index, ans.reply.decision_index)
        else:
            msg = m.PreemptionGrant(index=ans.index, horizon=ans.reply.horizon, valid_s=ans.reply.valid_s)
        c.send_to_rank(ans.rank, msg)
