"""Failures of outlast's own set-up: an attempt whose ranks could not meet is retried on a budget of its own.

Before a rank's train function runs, outlast sets up its process group (the torch backend's store and gloo's or
NCCL's connections). When that fails (a `RendezvousError`, or a rank that died before its set-up was done, with
the ranks waiting on it ended by the teardown), nothing of the user's has run yet: charging it to
`FailureConfig.max_failures` would spend a user's only retry on outlast's own trouble. Such an attempt draws on
`SETUP_RETRIES` instead, per launch of the driver, recorded in the history as `failure_counts["setup"]`. Past
that bound the failure is charged to max_failures as any other, so a set-up that fails every time still ends.

A rank's own exception (the user's, or one that no retry can mend, setup_errors.py) is never outlast's set-up,
nor is the death of a rank whose set-up was done (`SetUp`).
"""

from __future__ import annotations

from dataclasses import dataclass

from outlast.controller.policy import is_symptom
from outlast.protocol.kinds import Budget, FailureKind
from outlast.storage.records import FailureRecord

SETUP_RETRIES = 3
RENDEZVOUS_ERROR = "RendezvousError"  # outlast.errors.RendezvousError, as a failure record names it


@dataclass(frozen=True)
class SetupDecision:
    budget: Budget  # SETUP: retried on the set-up budget; WORKER: that budget is spent, charged as usual
    reason: str


def in_setup(f: FailureRecord, started: set[int], set_up: set[int]) -> bool:
    """Whether `f` is a failure of outlast's set-up: its rendezvous raised, or the rank died between its hello and
    the end of its set-up, without an exception of its own. A rank that died before its hello (in its fork, or
    importing the train function's module) is charged as before: nothing says it reached outlast's set-up."""
    if f.exc_type == RENDEZVOUS_ERROR:
        return True
    return f.rank in started and f.rank not in set_up and f.named is None and f.phase in (None, "setup")


def judge_setup(failures: list[FailureRecord], started: set[int], set_up: set[int], so_far: int,
                limit: int = SETUP_RETRIES) -> SetupDecision | None:
    """Pure: None when the attempt's failures are not all of outlast's set-up (or a teardown's symptoms of it);
    else the budget it draws on, with the reason. `started`: the ranks that said hello; `set_up`: those whose
    set-up was done; `so_far`: set-up failures earlier in this launch."""
    if not failures or any(f.kind in (FailureKind.NODE_LOST, FailureKind.HANG) for f in failures):
        return None
    if not any(in_setup(f, started, set_up) for f in failures):
        return None
    if not all(in_setup(f, started, set_up) or is_symptom(f) for f in failures):
        return None
    if so_far < limit:
        return SetupDecision(Budget.SETUP, f"the ranks could not meet in outlast's set-up, before the train function "
                                           f"ran: retrying (set-up failure {so_far + 1} of {limit}, not counted "
                                           f"against max_failures)")
    return SetupDecision(Budget.WORKER, f"the ranks could not meet in outlast's set-up, {so_far + 1} times since "
                                        f"this driver started, more than its {limit} retries: counted against "
                                        f"max_failures")
