"""Pure decisions of the controller: given counts and config, what to do and why."""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass

from outlast.protocol.kinds import FailureKind
from outlast.storage.records import FailureRecord


class FailureDecision(enum.Enum):
    RESTART = "restart"
    RAISE = "raise"


@dataclass(frozen=True)
class RestartDecision:
    action: FailureDecision
    reason: str


def decide_on_failure(failure: FailureRecord, failures_so_far: int, max_failures: int,
                      budget: str = "max_failures") -> RestartDecision:
    """`failures_so_far` counts earlier failed attempts, not this one.

    `max_failures` is the number of restarts allowed: 0 never restarts, -1 always does.
    `budget` names the FailureConfig field it comes from, for the reason.
    """
    cause = failure.describe()
    if max_failures < 0:
        return RestartDecision(
            FailureDecision.RESTART,
            f"{cause}; restarting (failure {failures_so_far + 1}, {budget}=-1 retries forever)",
        )
    if failures_so_far < max_failures:
        return RestartDecision(
            FailureDecision.RESTART,
            f"{cause}; restarting (failure {failures_so_far + 1} of {budget}={max_failures})",
        )
    return RestartDecision(
        FailureDecision.RAISE,
        f"{cause}; giving up: {failures_so_far + 1} failures exceed "
        f"FailureConfig({budget}={max_failures}) (raise it, or set -1 to retry forever)",
    )


# Errors a worker gets because a peer died under it: symptoms, not causes.
_PEER_LOSS_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "/gloo/", "nccl")


_NOT_THE_USERS = frozenset({FailureKind.NODE_LOST, FailureKind.SPAWN_REFUSED})


def is_symptom(f: FailureRecord) -> bool:
    """A peer's death seen from a survivor, or our own SIGTERM of a teardown."""
    text = f"{f.named or ''} {f.message or ''}".lower()
    return any(marker in text for marker in _PEER_LOSS_MARKERS) or f.signal == signal.SIGTERM


def is_users_error(f: FailureRecord) -> bool:
    """An exception raised by the train function itself, or a failure of a kind of outlast's that is not a lost
    node or a refused spawn (a hang, say): not a peer's death."""
    return bool(f.named) and f.kind not in _NOT_THE_USERS and not is_symptom(f)


def caused_by_drain(failures: list[FailureRecord], drained: set[str]) -> bool:
    """Whether a drain of the nodes `drained` explains every one of the failures: each is a peer's death seen
    from a survivor, or the loss of a drained node. A user's exception, a hang, or the loss of a node that
    is not drained has a cause of its own, charged to max_failures."""
    return all(is_symptom(f) or (f.node_id in drained and not is_users_error(f)) for f in failures)


def pick_root_cause(failures: list[FailureRecord]) -> FailureRecord:
    """The failure that most likely started it, from all the failures of one attempt.

    Peers of a dead worker fail too (their collective loses a partner) and may be
    reaped first, so arrival order alone would often blame a bystander. Ranked: an
    exception of the user's own, then a death by a signal we did not send (SIGKILL,
    SIGSEGV, ...) or a bare non-zero exit, then peer-loss errors and our own SIGTERMs.
    Ties go to the earliest.
    """
    if not failures:
        raise ValueError("pick_root_cause needs at least one failure")

    def rank(f: FailureRecord) -> int:
        text = f"{f.named or ''} {f.message or ''}".lower()
        if f.named and not any(marker in text for marker in _PEER_LOSS_MARKERS):
            return 0
        if f.signal is not None and f.signal != signal.SIGTERM:
            return 1
        if f.named is None and f.signal is None:
            return 1
        return 2

    return min(failures, key=lambda f: (rank(f), f.time))
