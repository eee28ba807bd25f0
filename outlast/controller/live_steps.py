"""What live recovery (`live.py` decides) does to the attempt: a rank's death answered by a replacement while
the survivors go on, the next generation published, and the recovery written to the history once the state
went across. A death it does not answer (a fallback, or max_failures spent) takes the usual restart.

Plain functions over the core's state, as `lifecycle.py`'s are."""

from __future__ import annotations

import logging
from collections import Counter

import msgspec

from outlast.controller import spawns
from outlast.controller import states as st
from outlast.controller.commit import PendingCheckpoint
from outlast.controller.core_state import CoreState
from outlast.controller.group import LiveJoined, PublishMembership, ToNode
from outlast.controller.heartbeat import heartbeat
from outlast.controller.live import FallBack, LiveRun
from outlast.controller.live_placement import replacement_node
from outlast.controller.placement import NoCapacity
from outlast.controller.policy import FailureDecision, decide_on_failure
from outlast.controller.types import AttemptState
from outlast.protocol import messages as m
from outlast.protocol.kinds import Budget, FailureKind
from outlast.storage.records import FailureRecord, LiveRecoveryRecord

log = logging.getLogger("outlast.controller")

STORE_VAR = "OUTLAST_LIVE_STORE"  # where a rank's live group meets: the controller's store, "host:port"
INCARNATION_VAR = "OUTLAST_LIVE_INCARNATION"  # how many times the rank was replaced in this attempt


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
    hang = live.hung.pop(rank, None)
    if hang is not None:  # the controller killed it: its death is the hang
        record = msgspec.structs.replace(record, kind=FailureKind.HANG, message=hang)
    if decide_on_failure(record, c.book.failures_this_launch(Budget.WORKER),
                         c.plan.max_failures).action is not FailureDecision.RESTART:
        return False  # the restart's verdict gives up, and says why
    node, where = a.placement[rank], ""
    if record.kind is FailureKind.NODE_LOST or node not in c.nodes.heard:
        held = Counter(a.placement[r] for r in a.placement if r != rank and r not in a.exited)
        moved = replacement_node([v for v in c.nodes.views(c.run_id, c.now) if v.node_id != node], dict(held),
                                 c.plan.per_worker, c.plan.strategy)
        if isinstance(moved, NoCapacity):
            return _fall_back(c, a, live, rank, record, f"rank {rank}'s node {node} is lost and {moved.reason}")
        node, where = moved.node_id, f"; forked on {moved.reason}"
    decision = live.on_death(rank, record.describe(), record.time)
    if isinstance(decision, FallBack):
        return _fall_back(c, a, live, rank, record, decision.reason)
    c.book.charge_live_failure(record)
    a.exited.pop(rank, None)
    a.pids.pop(rank, None)
    a.placement[rank] = node
    if c.nodes.link(node, c.now):
        c.out.append(ToNode(node, heartbeat(c)))  # the agent knows the run before its worker
    env = {**a.env, INCARNATION_VAR: str(decision.incarnation)}
    c.out.append(spawns.spawn(c, a, node, [a.specs[rank]], env))
    c.out.append(PublishMembership(a.number, decision.membership.to_json()))
    log.warning("attempt %d: %s; the other ranks go on: %s%s (failure %d of max_failures=%d)", a.number,
                record.describe(), decision.reason, where, c.book.failures_this_launch(Budget.WORKER),
                c.plan.max_failures)
    return True


def settled_by_death(c: CoreState, rank: int) -> list[PendingCheckpoint]:
    """After `on_death` replaced `rank`: the checkpoints its death settles (the caller begins their commits). The
    ranks that keep the state may have reported a step committed before the death, which the dead rank never
    will (its replacement reports from their count on); its asynchronous uploads never say they are done."""
    live = c.live
    if live is None:
        return []
    t = c.commit_tracker
    reported = max((t.reports[k] for k in range(len(t.reports)) if k not in live.unsent), default=0)
    return [*t.lose_uploads(rank), *t.fill(rank, reported)]


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


def on_report(c: CoreState, rank: int, index: int) -> list[PendingCheckpoint]:
    """Report `index` of `rank` was counted. One that a rank keeping the state made while a recovery is under way
    is of a step committed before the death: the lost ranks' reports of it never come, and are counted here.
    Returns the checkpoints that settled (the caller begins their commits)."""
    live = c.live
    if live is None:
        return []
    return [p for lost in live.owed_reports(rank) for p in c.commit_tracker.fill(lost, index + 1)]


def on_joined(c: CoreState, event: LiveJoined) -> None:
    a, live = c.attempt, c.live
    if a is None or live is None or event.attempt != a.number:
        return
    done = live.on_joined(event.generation, event.steps_lost, event.wall)
    if done is None:
        return
    c.book.note_live_recovery(LiveRecoveryRecord(
        attempt=a.number, ranks=list(done.ranks), cause=done.cause, path="live", time=done.since,
        generation=done.generation, steps_lost=done.steps_lost, seconds=done.seconds))
    log.warning("attempt %d: rank(s) %s took the state from the other ranks in generation %d, %.2f s after the "
                "death; %d step(s) lost", a.number, list(done.ranks), done.generation, done.seconds, done.steps_lost)


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

