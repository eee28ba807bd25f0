"""Pure decisions of the controller: given counts and config, what to do and why."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from outlast.storage.records import FailureRecord


class FailureDecision(enum.Enum):
    RESTART = "restart"
    RAISE = "raise"


@dataclass(frozen=True)
class Decision:
    action: FailureDecision
    reason: str


def decide_on_failure(failure: FailureRecord, failures_so_far: int, max_failures: int) -> Decision:
    """`failures_so_far` counts earlier failed attempts, not this one.

    `max_failures` is the number of restarts allowed: 0 never restarts, -1 always does.
    """
    cause = failure.describe()
    if max_failures < 0:
        return Decision(
            FailureDecision.RESTART,
            f"{cause}; restarting (failure {failures_so_far + 1}, max_failures=-1 retries forever)",
        )
    if failures_so_far < max_failures:
        return Decision(
            FailureDecision.RESTART,
            f"{cause}; restarting (failure {failures_so_far + 1} of max_failures={max_failures})",
        )
    return Decision(
        FailureDecision.RAISE,
        f"{cause}; giving up: {failures_so_far + 1} failures exceed "
        f"FailureConfig(max_failures={max_failures}) (raise it, or set -1 to retry forever)",
    )
