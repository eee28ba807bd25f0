"""What live recovery (`live.py` decides) does to the attempt: a rank's death answered by a replacement while
the survivors go on, the next generation published, and the recovery written to the history once the state
went across. A death it does not answer (a fallback, or max_failures spent) takes the usual restart. A drain
whose ranks can move live (`on_drain`) is told to the ranks as always, but moves them instead of ending the
attempt: their replacements are forked on nodes that stay, the planned generation is published once they
wait for it (`on_ready`), and the drained processes' exits are theirs alone (`retired`). With no room for them
in an elastic run, they leave (`Leave`): the planned generation, smaller, goes out once the ranks were told, and
the drained processes' exits take their ranks out of the attempt, as a shrink's lost ranks are.

Plain functions over the core's state, as `lifecycle.py`'s are."""

from __future__ import annotations

import dataclasses
import logging

import msgspec


from outlast.controller import spawns
from outlast.controller import states as st
from outlast.controller.commit import PendingCheckpoint
from outlast.controller.core_state import CoreState
from outlast.controller.group import LiveJoined, LiveReady, PublishMembership, Spawn, StopRun, ToNode
from outlast.controller.heartbeat import heartbeat
from outlast.controller.live import FallBack, Leave, LiveRun, StayPut
from outlast.controller.live_room import where_to
from outlast.controller.placement import NoCapacity
from outlast.controller.policy import FailureDecision, decide_on_failure
from outlast.controller.preemption import Preemption
from outlast.controller.types import AttemptState
from outlast.protocol import messages as m
from outlast.protocol.kinds import Budget, FailureKind
from outlast.protocol.transport import INCARNATION_VAR, LIVE_GROUP_RANK_VAR, LIVE_STORE_VAR
from outlast.storage.records import FailureRecord, LiveRecoveryRecord, ResizeRecord

log = logging.getLogger("outlast.controller")

STORE_VAR = LIVE_STORE_VAR  # where a rank's live group meets: the controller's store, "host:port"
# INCARNATION_VAR (protocol/transport.py): how many times the rank was replaced in this attempt
# How long a planned generation waits for the drain's notice to be fixed (`horizons.py`) once its new members
# wait: past it, a loop that stopped asking get_preemption_info() does not hold the move up until the deadline.
NOTICE_WAIT_S = 2.0


def begin(c: CoreState, a: AttemptState, world_size: int) -> dict[str, str]:
    """A new attempt of a live-recovery run: generation 0 is its ranks as placed. Returns their environment."""
    c.live = LiveRun(world_size)
    c.out.append(PublishMembership(a.number, c.live.membership.to_json()))
    return {STORE_VAR: c.plan.live_store, INCARNATION_VAR: "0"}


def on_death(c: CoreState, a: AttemptState, rank: int, record: FailureRecord) -> bool:
    """True when live recovery answers the death of `rank`: the attempt goes on. False: restart as usual."""
    live = c.live
    if live is None or not isinstance(c.state, st.Running):
        return False
    if rank in a.lost:
        return True  # a rank of a node whose loss shrank the group: left out of it already
    hang = live.hung.pop(rank, None)
    if hang is not None:  # the controller killed it: its death is the hang
        record = msgspec.structs.replace(record, kind=FailureKind.HANG, message=hang)
    node, where = a.placement[rank], ""
    lost = record.kind is FailureKind.NODE_LOST or node not in c.nodes.heard
    if not (lost and live.losing(node)) and decide_on_failure(
            record, c.book.failures_this_launch(Budget.WORKER), c.plan.max_failures).action is not FailureDecision.RESTART:
        return False  # the restart's verdict gives up, and says why (a node's loss is judged at its first rank)
    _publish_planned(c, a, live)  # a planned generation goes first: the next one is built on it
    if lost:
        # Where placement would put it, beside the ranks that live (the lost node takes no work). The node's other
        # ranks die with it, each told in turn: room is found for all of them at the first, or the node's loss
        # falls back to one restart at once (not after some of them were replaced, and charged, already).
        living = {r: n for r, n in a.placement.items() if r == rank or r not in a.exited}
        doomed = sorted(r for r, n in living.items() if n == node)
        moved = where_to([v for v in c.nodes.views(c.run_id, c.now) if v.node_id != node], living, doomed,
                         c.plan.per_worker, c.plan.strategy)
        if isinstance(moved, NoCapacity):
            return _shrink(c, a, live, rank, record, doomed, node, moved.reason)
        if unheld := live.unheld(doomed):
            return _fall_back(c, a, live, rank, record, f"node {node} is lost with rank(s) {doomed}, and {unheld}")
        node, where = moved[rank], f"; forked on node {moved[rank]}"
    decision = live.on_death(rank, record.describe(), record.time, finished=_finished(a, [rank]),
                             lost_node=a.placement[rank] if lost else None)
    if isinstance(decision, FallBack):
        return _fall_back(c, a, live, rank, record, decision.reason)
    if decision.charged:
        c.book.charge_live_failure(record)
    a.exited.pop(rank, None)
    a.pids.pop(rank, None)
    a.placement[rank] = node
    if c.nodes.link(node, c.now):
        c.out.append(ToNode(node, heartbeat(c)))  # the agent knows the run before its worker
    env = {**a.env, INCARNATION_VAR: str(decision.incarnation), **group_rank(live, rank)}
    c.out.append(replacement(c, a, rank, env))  # on a.placement[rank]: the node found above when its own is lost
    c.out.append(PublishMembership(a.number, decision.membership.to_json()))
    log.warning("attempt %d: %s; the other ranks go on: %s%s (failure %d of max_failures=%d)", a.number,
                record.describe(), decision.reason, where, c.book.failures_this_launch(Budget.WORKER),
                c.plan.max_failures)
    return True


def _shrink(c: CoreState, a: AttemptState, live: LiveRun, rank: int, record: FailureRecord, doomed: list[int],
            node: str, no_room: str) -> bool:
    """Node `node` is lost with `doomed`, and no other node has room for them: an elastic run goes on without them,
    smaller, its lost ranks out of the attempt (`a.lost`: nothing waits for them, as for a preempted node's under
    relaxed collectives). Else, or when the smaller world is not allowed, the usual restart."""
    why = f"rank(s) {doomed} of lost node {node} have no room on another node: {no_room}"
    elastic = c.resizes.elastic
    if elastic is None:
        return _fall_back(c, a, live, rank, record, why)
    before = len(live.slots)
    decision = live.on_shrink(doomed, f"shrink: {record.describe()}", record.time, elastic.min_workers, node,
                              finished=_finished(a, doomed))
    if isinstance(decision, FallBack):
        return _fall_back(c, a, live, rank, record, f"{why}, and the run cannot shrink: {decision.reason}")
    c.book.charge_live_failure(record)
    a.lost |= set(doomed)
    a.done |= set(doomed)  # they have nothing more to say
    after = len(live.slots)
    c.book.note_size(after, ResizeRecord(attempt=a.number, from_workers=before, to_workers=after,
                                         reason=f"shrink, live: node {node} lost", steps_lost=1, time=c.wall()),
                     c.wall())
    c.resizes.since = c.now
    c.out.append(PublishMembership(a.number, decision.membership.to_json()))
    log.warning("attempt %d: %s; %s; %s (failure %d of max_failures=%d)", a.number, record.describe(), why,
                decision.reason, c.book.failures_this_launch(Budget.WORKER), c.plan.max_failures)
    return True


def _finished(a: AttemptState, besides: list[int]) -> tuple[int, ...]:
    """The ranks, but `besides`, whose loop returned (their process exited cleanly), in the group: a drained rank
    that left it returned from the loop too, and is no such rank."""
    return tuple(sorted(r for r, e in a.exited.items() if r not in besides and r not in a.lost and e.exit_code == 0
                        and e.error is None))


def held(a: AttemptState) -> dict[int, str]:
    """Where the attempt's ranks are, but those a shrink left out: they hold nothing (their node is gone)."""
    return {r: n for r, n in a.placement.items() if r not in a.lost}


def group_rank(live: LiveRun, rank: int) -> dict[str, str]:
    """The environment that tells a forked rank its rank and world in the live group, when a shrink numbered the
    group afresh (its spec keeps the number it was spawned as: what its messages to the controller carry)."""
    if live.slots == list(range(len(live.slots))):
        return {}
    return {LIVE_GROUP_RANK_VAR: f"{live.slots.index(rank)}/{len(live.slots)}"}


def replacement(c: CoreState, a: AttemptState, rank: int, env: dict[str, str]) -> Spawn:
    """The fork of a new member for `rank` (a dead rank's replacement, a drained rank's, a rank a grow added), on
    `a.placement[rank]`. It takes the state from the other ranks, and restores no checkpoint: the attempt's may be
    gone since it began (num_to_keep), and a loop that found one would fail on it before it joined."""
    fork = spawns.spawn(c, a, a.placement[rank], [a.specs[rank]], env)
    return dataclasses.replace(fork, msg=msgspec.structs.replace(fork.msg, restore_checkpoint=None))


def _fall_back(c: CoreState, a: AttemptState, live: LiveRun, rank: int, record: FailureRecord, reason: str) -> bool:
    c.live = None
    c.book.note_live_recovery(LiveRecoveryRecord(
        attempt=a.number, ranks=[rank], cause=record.describe(), path="restart", time=record.time,
        generation=live.membership.generation, reason=reason))
    log.warning("attempt %d: %s; live recovery falls back to a restart: %s", a.number, record.describe(), reason)
    return False


def on_hang(c: CoreState, a: AttemptState, rank: int, summary: str) -> bool:
    """The hang watch blames `rank`: True when it is killed (outlast started it) and its death is answered as any
    other's; its peers' collective fails as its sockets close. False: the hung attempt restarts as usual."""
    live = c.live
    if live is None or not isinstance(c.state, st.Running) or rank not in a.placement or rank in a.exited \
            or not live.on_hang(rank, summary):
        return False
    c.out.append(ToNode(a.placement[rank], m.KillRanks(run_id=c.run_id, attempt=a.number, ranks=[rank],
                                                       reason=f"rank {rank} hung; live recovery replaces it")))
    log.error("attempt %d: %s; rank %d is killed and replaced while the others go on", a.number, summary, rank)
    return True


def on_joined(c: CoreState, event: LiveJoined) -> None:
    a, live = c.attempt, c.live
    if a is None or live is None or event.attempt != a.number:
        return
    done = live.on_joined(event.generation, event.steps_lost, event.wall, event.shards, event.mesh)
    if done is None:
        return
    c.book.note_live_recovery(LiveRecoveryRecord(
        attempt=a.number, ranks=list(done.ranks), cause=done.cause, path="live", time=done.since,
        generation=done.generation, steps_lost=done.steps_lost, seconds=done.seconds))
    log.warning("attempt %d: rank(s) %s took the state from the other ranks in generation %d, %.2f s after the "
                "death; %d step(s) lost", a.number, list(done.ranks), done.generation, done.seconds, done.steps_lost)


def unread(c: CoreState) -> list[tuple[int, int]]:
    """The (attempt, generation) of the recovery under way's earlier generations whose word the runtime reads too
    (`LiveRun.unread`), before the newest's (`awaited`)."""
    a, live = c.attempt, c.live
    if a is None or live is None:
        return []
    return [(a.number, g) for g in live.unread()]


def awaited(c: CoreState) -> tuple[int, int] | None:
    """The (attempt, generation) the runtime watches the store for: generation 0 until the ranks formed it, then
    the generation of a recovery under way, if any."""
    a, live = c.attempt, c.live
    if a is None or live is None:
        return None
    if not live.formed:
        return a.number, 0
    if live.recovery is None:
        return None
    return a.number, live.membership.generation



# ---- a drained node's ranks move ---------------------------------------------------------------------


def on_drain(c: CoreState, a: AttemptState, p: Preemption) -> bool:
    """True when the drained ranks move live: the ranks are told of the drain as always, and the attempt goes on
    while their replacements start elsewhere. False: the drain takes its usual path (a checkpoint, a restart)."""
    live = c.live
    if live is None or not isinstance(c.state, st.Running) or a.preemption is not None:
        return False  # one notice per attempt: the ranks were told of an earlier one already
    spent = c.book.failures_this_launch(Budget.PREEMPTION)
    if 0 <= c.plan.max_preemption_failures <= spent:
        return False  # the restart's verdict gives up, and says why
    cause = f"drain: {p.as_failure(a.number).message}"
    room = where_to(c.nodes.views(c.run_id, c.now), held(a), p.ranks, c.plan.per_worker, c.plan.strategy)
    elastic = c.resizes.elastic
    before = len(live.slots)
    decision = live.on_drain(p.ranks, cause, c.wall(), no_room=room.reason if isinstance(room, NoCapacity) else None,
                             least=elastic.min_workers if elastic is not None else None)
    if isinstance(decision, StayPut):
        c.book.note_live_recovery(LiveRecoveryRecord(
            attempt=a.number, ranks=list(p.ranks), cause=cause, path="restart", time=c.wall(),
            generation=live.membership.generation, reason=decision.reason))
        log.warning("attempt %d: %s; live recovery does not move them: %s", a.number, cause, decision.reason)
        return False
    c.book.charge_live_failure(p.as_failure(a.number), Budget.PREEMPTION)
    a.preemption = p
    if isinstance(decision, Leave):
        # Nothing to fork: the drained ranks leave once told, and their processes' exits are no failure.
        a.retiring |= {(rank, a.placement[rank]) for rank in decision.ranks}
        after = len(live.slots)
        c.book.note_size(after, ResizeRecord(attempt=a.number, from_workers=before, to_workers=after,
                                             reason=f"shrink, live: {cause}", steps_lost=0, time=c.wall()), c.wall())
        c.resizes.since = c.now
        log.warning("attempt %d: %s; %s", a.number, cause, decision.reason)
        return True
    assert not isinstance(room, NoCapacity)
    for rank in decision.ranks:
        old, new = a.placement[rank], room[rank]
        a.retiring.add((rank, old))
        a.placement[rank] = new
        a.pids.pop(rank, None)
        beside = sum(1 for r, n in a.placement.items() if n == new and r != rank)
        a.specs[rank] = msgspec.structs.replace(a.specs[rank], local_rank=beside, local_world_size=beside + 1)
        if c.nodes.link(new, c.now):
            c.out.append(ToNode(new, heartbeat(c)))  # the agent knows the run before its workers
        env = {**a.env, INCARNATION_VAR: str(decision.incarnations[rank]), **group_rank(live, rank)}
        c.out.append(replacement(c, a, rank, env))  # on `new`; it takes the state from the ranks that stay
    log.warning("attempt %d: %s; %s (to %s)", a.number, cause, decision.reason,
                ", ".join(f"rank {r} on {room[r]}" for r in decision.ranks))
    return True


# ---- an elastic run grows ------------------------------------------------------------------------------


def on_grow(c: CoreState, a: AttemptState, to_workers: int, why: str) -> bool:
    """True when the grow is live (the added ranks forked, to take the state from the running ranks) or waits for
    a recovery under way; False: it takes its usual path (a checkpoint saved on a notice, a restart larger)."""
    live = c.live
    if live is None or not isinstance(c.state, st.Running):
        return False
    current = live.membership.world_size
    added = live.added_for(to_workers)
    room = where_to(c.nodes.views(c.run_id, c.now), held(a), added, c.plan.per_worker, c.plan.strategy)
    if isinstance(room, NoCapacity):
        return False
    cause = f"grow: from {current} to {to_workers} workers ({why})"
    decision = live.on_grow(to_workers, cause, c.wall())
    if isinstance(decision, StayPut):
        if not decision.later:
            log.info("attempt %d: %s; not live: %s", a.number, cause, decision.reason)
        return decision.later
    # The trackers count every rank the attempt numbered, a shrink's lost ones too (lost in them).
    numbered = max(added) + 1
    c.plan = dataclasses.replace(c.plan, world_size=numbered)
    c.commit_tracker.grow(numbered)
    c.collectives.grow(numbered)
    if c.hangs is not None:
        c.hangs.ranks = numbered
    c.book.note_size(to_workers, ResizeRecord(attempt=a.number, from_workers=current, to_workers=to_workers,
                                             reason=f"grow, live: {why}", steps_lost=0, time=c.wall()), c.wall())
    c.resizes.since = c.now
    for rank in decision.ranks:
        node = room[rank]
        beside = sum(1 for n in held(a).values() if n == node)
        a.placement[rank] = node
        node_rank = list(dict.fromkeys(n for _, n in sorted(held(a).items()))).index(node)
        a.specs[rank] = m.WorkerSpec(rank=rank, local_rank=beside, local_world_size=beside + 1,
                                     node_rank=node_rank, world_size=to_workers)
        if c.nodes.link(node, c.now):
            c.out.append(ToNode(node, heartbeat(c)))
        env = {**a.env, INCARNATION_VAR: str(decision.incarnations[rank]), **group_rank(live, rank)}
        c.out.append(replacement(c, a, rank, env))  # on `node`; it takes the state from the running ranks
    log.warning("attempt %d: %s; %s (%s)", a.number, cause, decision.reason,
                ", ".join(f"rank {r} on {room[r]}" for r in decision.ranks))
    return True


def on_ready(c: CoreState, event: LiveReady) -> None:
    """A new member of a planned generation waits for it in the store."""
    a, live = c.attempt, c.live
    if a is None or live is None or event.attempt != a.number:
        return
    live.on_started(event.member)
    publish_if_ready(c)


def publish_if_ready(c: CoreState) -> None:
    """The planned generation goes out once its new members wait for it and the ranks were told the drain's
    notice (fixed at once, or at the ranks' next calls of get_preemption_info(); `NOTICE_WAIT_S` at most)."""
    a, live = c.attempt, c.live
    if a is None or live is None or live.unpublished is None:
        return
    noticed = c.horizons.noticed_at
    told = a.preemption is None or c.horizons.decision_index is not None or \
        (noticed is not None and c.now - noticed >= NOTICE_WAIT_S)
    membership = live.publishable(told=told)
    if membership is not None:
        c.out.append(PublishMembership(a.number, membership.to_json()))
        log.info("attempt %d: the new members wait; generation %d is published", a.number, membership.generation)


def starting(c: CoreState) -> list[tuple[int, str]]:
    """The (attempt, member) the runtime watches the store for: a planned generation's new members, until they wait."""
    a, live = c.attempt, c.live
    if a is None or live is None:
        return []
    return [(a.number, member) for member in live.starting_members()]


def retired(c: CoreState, a: AttemptState, ev: m.WorkerExited) -> bool:
    """The exit of a drained rank's process that a move replaced: not the rank's (its replacement holds it)."""
    if (ev.rank, ev.node_id) not in a.retiring:
        return False
    live = c.live
    if live is not None and live.unpublished is not None and ev.exit_code == 0 and ev.error is None:
        abandon(c, a)  # it returned from the loop: the training ended before the move; its exit is the rank's
        return False
    if _its_rank_s_again(c, a, ev):
        a.retiring.discard((ev.rank, ev.node_id))
        return False
    a.retiring.discard((ev.rank, ev.node_id))
    if live is not None and (ev.exit_code != 0 or ev.error is not None) \
            and (again := live.on_retired_death()) is not None:
        c.out.append(PublishMembership(a.number, again.to_json()))
        log.warning("attempt %d: rank %d's drained process on %s died before generation %d formed: generation %d "
                    "goes out unplanned, so that the step in flight is thrown away everywhere", a.number, ev.rank,
                    ev.node_id, again.generation - 1, again.generation)
    left = live is not None and ev.rank not in live.slots
    if left:
        a.lost.add(ev.rank)  # the caller takes it out of the trackers (handlers.lose_shrunk_ranks)
        a.done.add(ev.rank)
        a.exited[ev.rank] = ev
    log.info("attempt %d: rank %d's drained process on %s exited (%s); %s", a.number, ev.rank, ev.node_id,
             "cleanly" if ev.exit_code == 0 and ev.error is None else f"exit code {ev.exit_code}, signal {ev.signal}",
             "the group went on without it" if left else "its replacement holds the rank")
    return True


def _its_rank_s_again(c: CoreState, a: AttemptState, ev: m.WorkerExited) -> bool:
    """Live recovery fell back since: a drained rank that was to leave the group is its rank's only process (on the
    node the rank is placed on), and the attempt's restart waits for its exit. Taken for no rank's, it waited for
    ever."""
    return c.live is None and a.placement.get(ev.rank) == ev.node_id


def moved_out(c: CoreState, rank: int) -> list[PendingCheckpoint]:
    """A moved rank's drained process exited before its replacement's first report: the committed steps it did not
    report (it left, or died, between a committed step and its report), its replacement, which reports from the
    count of the rank that sent it the state, never will. Until that first report no checkpoint waits for the rank
    (`CommitTracker.replaced`), as for a dead rank's replacement; returns the checkpoints that settled."""
    live = c.live
    if live is None or rank not in live.slots or rank not in live.unreported:
        return []
    return c.commit_tracker.replaced(rank)


def on_clean_exit(c: CoreState, a: AttemptState, rank: int) -> None:
    """A rank returned from the loop. If a planned generation still waits to go out, the training ended first."""
    live = c.live
    if live is not None and live.unpublished is not None and rank not in live.joining():
        abandon(c, a)


def abandon(c: CoreState, a: AttemptState) -> None:
    """The loop ended before a planned generation's new members waited for it: it never goes out. A drained rank
    is its own process's again (its replacement's exit is no rank's now); an added rank is done, having nothing
    to report. The new members, waiting in vain, are stopped where no other rank runs."""
    live = c.live
    assert live is not None and live.unpublished is not None
    joiners = live.joining()
    for rank, node in [x for x in a.retiring if x[0] not in live.slots]:
        a.retiring.discard((rank, node))  # they were to leave the group (`Leave`): their exits are theirs again
    log.info("attempt %d: %s", a.number, live.abandon_move())
    for rank in joiners:
        node = a.placement[rank]
        drained = next((n for r, n in a.retiring if r == rank), None)
        if drained is not None:
            a.retiring.discard((rank, drained))
            a.retiring.add((rank, node))
            a.placement[rank] = drained
        else:
            a.exited.setdefault(rank, m.WorkerExited(run_id=c.run_id, attempt=a.number, rank=rank, pid=0,
                                                     exit_code=0, signal=None, error=None, node_id=node))
            a.done.add(rank)
        if not [r for r, n in a.placement.items() if n == node and r not in a.exited]:
            c.out.append(StopRun(node, m.StopWorkers(run_id=c.run_id, attempt=a.number,
                                                     grace_s=c.plan.timeouts.teardown_grace_s)))


def _publish_planned(c: CoreState, a: AttemptState, live: LiveRun) -> None:
    membership = live.take_unpublished()
    if membership is not None:
        c.out.append(PublishMembership(a.number, membership.to_json()))
