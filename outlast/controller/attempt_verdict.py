"""How a failed or preempted attempt ends: which budget it draws on, and whether the run goes on.

Called once every worker of the attempt has exited. Writes the verdict to the run's
history and returns it; the core carries it out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

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
class AttemptVerdict:
    retry: bool
    error: TrainingFailedError | None = None  # set when the run gives up


def restored_by(book: RunBook, attempt: int) -> str | None:
    """The checkpoint attempt `attempt` restored, which its ranks found corrupt, while it is still committed: not
    the latest, which may be newer (a commit of the attempt before landed once it had begun) and unharmed."""
    restored = next((a.restored_from for a in book.state.attempts if a.attempt == attempt), None)
    return restored if any(r.checkpoint_dir == restored for r in book.state.checkpoints) else None


def judge_attempt(book: RunBook, attempt: int, failures: list[FailureRecord], history: list[FailureRecord],
                   preemption: Preemption | None, max_failures: int, max_preemption_failures: int,
                   wall: float, started: frozenset[int] | set[int] = frozenset(),
                   set_up: frozenset[int] | set[int] = frozenset()) -> AttemptVerdict:
    """`failures` are this attempt's, `history` every earlier attempt's (extended here, root causes first);
    `started`: the ranks that said hello, `set_up`: those whose set-up was done (setup_failures.py)."""
    if preemption is not None:
        return _judge_preempted(book, attempt, failures, history, preemption, max_preemption_failures, wall)
    root = pick_root_cause(failures)
    others = [f for f in failures if f is not root]
    history += [root, *others]
    also = "".join(f"\n  then {f.describe()}" for f in others)
    corrupt = root.kind is FailureKind.CORRUPT_CHECKPOINT and book.state.latest_checkpoint
    if corrupt or root.kind is FailureKind.SPAWN_REFUSED:
        book.fail_attempt(root, Budget.CORRUPT_CHECKPOINT if corrupt else Budget.PLACEMENT, wall)
        if corrupt:
            restored = restored_by(book, attempt)  # None: it is gone already, and the next attempt takes the latest
            fallback = book.skip_checkpoint(restored, root.message or "unreadable", wall) if restored \
                else book.state.latest_checkpoint
            log.warning("%s; restarting from %s instead (not counted against max_failures)", root.message,
                        fallback or "scratch")
        return AttemptVerdict(retry=True)
    setup = judge_setup(failures, set(started), set(set_up), book.failures_this_launch(Budget.SETUP))
    if setup is not None and setup.budget is Budget.SETUP:
        book.fail_attempt(root, Budget.SETUP, wall)
        book.note_once(f"attempt {attempt}: {root.describe()}; {setup.reason}", wall)
        log.warning("%s; %s%s", root.describe(), setup.reason, also)
        return AttemptVerdict(retry=True)
    if setup is not None:
        log.warning("%s", setup.reason)
    decision = decide_on_failure(root, book.failures_this_launch(Budget.WORKER), max_failures)
    book.fail_attempt(root, Budget.WORKER, wall)
    hopeless = no_retry_can_mend(root)
    if hopeless is not None:
        return AttemptVerdict(retry=False, error=TrainingFailedError(f"training failed: {hopeless}", list(history)))
    if root.traceback:
        log.warning("rank %d failed:\n%s", root.rank, root.traceback.rstrip())
    if decision.action is FailureDecision.RESTART:
        log.warning("%s%s", decision.reason, also)
        return AttemptVerdict(retry=True)
    causes = "\n".join(f"  attempt {f.attempt}: {f.describe()}" for f in history)
    return AttemptVerdict(retry=False, error=TrainingFailedError(
        f"training failed: {decision.reason}\nfailures (root cause of each attempt first):\n{causes}", list(history)))


def _judge_preempted(book: RunBook, attempt: int, failures: list[FailureRecord], history: list[FailureRecord],
                      preemption: Preemption, max_preemption_failures: int, wall: float) -> AttemptVerdict:
    root = preemption.as_failure(attempt)
    book.add_failure(root)
    history += [root, *failures]
    decision = decide_on_failure(root, book.failures_this_launch(Budget.PREEMPTION), max_preemption_failures,
                                 budget="max_preemption_failures")
    book.fail_attempt(root, Budget.PREEMPTION, wall)
    if decision.action is FailureDecision.RESTART:
        log.warning("%s", decision.reason)
        return AttemptVerdict(retry=True)
    return AttemptVerdict(retry=False, error=PreemptionError(f"training stopped: {decision.reason}", list(history)))
