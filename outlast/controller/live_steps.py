"""What live recovery (`live.py` decides) does to the attempt: a rank's death answered by a replacement while
the survivors go on, the next generation published, and the recovery written to the history once the state
went across. A death it does not answer (a fallback, or max_failures spent) takes the usual restart.

Plain functions over the core's state, as `lifecycle.py`'s are."""

from __future__ import annotations

import dataclasses
import logging

import msgspec

from outlast.controller import spawns
from outlast.controller import states as st
from outlast.controller.core_state import CoreState
from outlast.controller.group import LiveJoined, PublishMembership, Spawn
from outlast.controller.live import FallBack, LiveRun
from outlast.controller.policy import FailureDecision, decide_on_failure
from outlast.controller.types import AttemptState
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
    if decide_on_failure(record, c.book.failures_this_launch(Budget.WORKER),
                         c.plan.max_failures).action is not FailureDecision.RESTART:
        return False  # the restart's verdict gives up, and says why
    finished = tuple(sorted(r for r, e in a.exited.items() if r != rank and e.exit_code == 0 and e.error is None))
    decision = live.on_death(rank, record.describe(), record.time, node_lost=record.kind is FailureKind.NODE_LOST,
                             finished=finished)
    if isinstance(decision, FallBack):
        c.live = None
        c.book.note_live_recovery(LiveRecoveryRecord(
            attempt=a.number, ranks=[rank], cause=record.describe(), path="restart", time=record.time,
            generation=live.membership.generation, reason=decision.reason))
        log.warning("attempt %d: %s; live recovery falls back to a restart: %s", a.number, record.describe(),
                    decision.reason)
        return False
    c.book.charge_live_failure(record)
    a.exited.pop(rank, None)
    a.pids.pop(rank, None)
    env = {**a.env, INCARNATION_VAR: str(decision.incarnation)}
    c.out.append(replacement(c, a, rank, env))
    c.out.append(PublishMembership(a.number, decision.membership.to_json()))
    log.warning("attempt %d: %s; the other ranks go on: %s (failure %d of max_failures=%d)", a.number,
                record.describe(), decision.reason, c.book.failures_this_launch(Budget.WORKER), c.plan.max_failures)
    return True


def replacement(c: CoreState, a: AttemptState, rank: int, env: dict[str, str]) -> Spawn:
    """The fork of `rank`'s replacement. It takes the state from the other ranks, and restores no checkpoint: the
    attempt's may be gone since it began (num_to_keep), and a loop that found one would fail on it before it
    joined."""
    fork = spawns.spawn(c, a, a.placement[rank], [a.specs[rank]], env)
    return dataclasses.replace(fork, msg=msgspec.structs.replace(fork.msg, restore_checkpoint=None))


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

