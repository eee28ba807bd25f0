"""How a failed or preempted attempt ends: which budget it draws on, and whether the run goes on.

Called once every worker of the attempt has exited. Pure: it reads the history through
`AttemptFacts`, a frozen view taken before the verdict, and returns the verdict with the
history's changes as data (`changes`), which only the core writes (`lifecycle.write_verdict`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Union

from outlast.controller.policy import FailureDecision, decide_on_failure, pick_root_cause
from outlast.controller.preemption import Preemption
from outlast.controller.runstate import RunBook
from outlast.controller.setup_errors import no_retry_can_mend
from outlast.controller.setup_failures import judge_setup
from outlast.protocol.kinds import Budget, FailureKind
from outlast.storage.records import FailureRecord
from outlast.errors import PreemptionError, TrainingFailedError

log = logging.getLogger("outlast.controller")


@dataclass(frozen=True)
class FailAttempt:
    """End the attempt as failed, `root` first among its failures, charged to `budget`."""
    root: FailureRecord
    budget: Budget


@dataclass(frozen=True)
class AddFailure:
    """A failure of the attempt's that no rank reported (the preemption itself)."""
    record: FailureRecord


@dataclass(frozen=True)
class SkipRestored:
    """Restore no more from the checkpoint the attempt found unreadable."""
    checkpoint_dir: str
    reason: str


@dataclass(frozen=True)
class HistoryNote:
    """A line for the run's history, written once."""
    text: str


@dataclass(frozen=True)
class EndAttempt:
    """End the attempt with `outcome` ("resized"), no budget charged."""
    outcome: str


BookChange = Union[FailAttempt, AddFailure, SkipRestored, HistoryNote, EndAttempt]


@dataclass(frozen=True)
class AttemptVerdict:
    retry: bool
    error: TrainingFailedError | None = None  # set when the run gives up
    changes: tuple[BookChange, ...] = ()  # for the run's history, in order
    blamed: tuple[FailureRecord, ...] = ()  # for the controller's list of every attempt's failures, root causes first


@dataclass(frozen=True)
class AttemptFacts:
    """What a verdict reads of the history, taken before any of its changes is written."""
    latest_checkpoint: str | None
    restored: str | None  # the checkpoint the attempt restored, while it is still committed (`restored_by`)
    spent: dict[Budget, int]  # failures charged to each budget since this driver launched

    @classmethod
    def of(cls, book: RunBook, attempt: int) -> "AttemptFacts":
        return cls(book.state.latest_checkpoint, restored_by(book, attempt),
                   {b: book.failures_this_launch(b) for b in Budget})


def restored_by(book: RunBook, attempt: int) -> str | None:
    """The checkpoint attempt `attempt` restored, which its ranks found corrupt, while it is still committed: not
    the latest, which may be newer (a commit of the attempt before landed once it had begun) and unharmed."""
    restored = next((a.restored_from for a in book.state.attempts if a.attempt == attempt), None)
    return restored if any(r.checkpoint_dir == restored for r in book.state.checkpoints) else None


def judge_attempt(facts: AttemptFacts, attempt: int, failures: list[FailureRecord], history: list[FailureRecord],
                   preemption: Preemption | None, max_failures: int, max_preemption_failures: int,
                   started: frozenset[int] | set[int] = frozenset(),
                   set_up: frozenset[int] | set[int] = frozenset()) -> AttemptVerdict:
    """`failures` are this attempt's, `history` every earlier attempt's (read only; what to add to it is the
    verdict's `blamed`); `started`: the ranks that said hello, `set_up`: those whose set-up was done
    (setup_failures.py)."""
    if preemption is not None:
        return _judge_preempted(facts, attempt, failures, history, preemption, max_preemption_failures)
    root = pick_root_cause(failures)
    others = [f for f in failures if f is not root]
    blamed = (root, *others)
    also = "".join(f"\n  then {f.describe()}" for f in others)
    corrupt = root.kind is FailureKind.CORRUPT_CHECKPOINT and facts.latest_checkpoint
    if corrupt or root.kind is FailureKind.SPAWN_REFUSED:
        charged = FailAttempt(root, Budget.CORRUPT_CHECKPOINT if corrupt else Budget.PLACEMENT)
        # No restored checkpoint still committed: it is gone already, and the next attempt takes the latest.
        skip = (SkipRestored(facts.restored, root.message or "unreadable"),) if corrupt and facts.restored else ()
        return AttemptVerdict(retry=True, changes=(charged, *skip), blamed=blamed)
    setup = judge_setup(failures, set(started), set(set_up), facts.spent.get(Budget.SETUP, 0))
    if setup is not None and setup.budget is Budget.SETUP:
        log.warning("%s; %s%s", root.describe(), setup.reason, also)
        return AttemptVerdict(retry=True, blamed=blamed, changes=(
            FailAttempt(root, Budget.SETUP), HistoryNote(f"attempt {attempt}: {root.describe()}; {setup.reason}")))
    if setup is not None:
        log.warning("%s", setup.reason)
    decision = decide_on_failure(root, facts.spent.get(Budget.WORKER, 0), max_failures)
    charged = FailAttempt(root, Budget.WORKER)
    hopeless = no_retry_can_mend(root)
    if hopeless is not None:
        return AttemptVerdict(retry=False, changes=(charged,), blamed=blamed, error=TrainingFailedError(
            f"training failed: {hopeless}", [*history, *blamed]))
    if root.traceback:
        log.warning("rank %d failed:\n%s", root.rank, root.traceback.rstrip())
    if decision.action is FailureDecision.RESTART:
        log.warning("%s%s", decision.reason, also)
        return AttemptVerdict(retry=True, changes=(charged,), blamed=blamed)
    causes = "\n".join(f"  attempt {f.attempt}: {f.describe()}" for f in [*history, *blamed])
    return AttemptVerdict(retry=False, changes=(charged,), blamed=blamed, error=TrainingFailedError(
        f"training failed: {decision.reason}\nfailures (root cause of each attempt first):\n{causes}",
        [*history, *blamed]))


def _judge_preempted(facts: AttemptFacts, attempt: int, failures: list[FailureRecord], history: list[FailureRecord],
                      preemption: Preemption, max_preemption_failures: int) -> AttemptVerdict:
    root = preemption.as_failure(attempt)
    blamed = (root, *failures)
    decision = decide_on_failure(root, facts.spent.get(Budget.PREEMPTION, 0), max_preemption_failures,
                                 budget="max_preemption_failures")
    changes = (AddFailure(root), FailAttempt(root, Budget.PREEMPTION))
    if decision.action is FailureDecision.RESTART:
        log.warning("%s", decision.reason)
        return AttemptVerdict(retry=True, changes=changes, blamed=blamed)
    return AttemptVerdict(retry=False, changes=changes, blamed=blamed, error=PreemptionError(
        f"training stopped: {decision.reason}", [*history, *blamed]))
