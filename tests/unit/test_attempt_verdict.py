"""An attempt's verdict is pure: it reads the history through a frozen view and returns its changes as data.
The core writes them (lifecycle.write_verdict); until then the run's history is as it was."""

import msgspec
import pytest

from outlast.controller.attempt_verdict import (AddFailure, AttemptFacts, EndAttempt, FailAttempt, HistoryNote,
                                                SkipRestored, judge_attempt)
from outlast.controller.lifecycle import write_verdict
from outlast.controller.preemption import Preemption
from outlast.controller.resize import Elastic, Resizes
from outlast.controller.runstate import RunBook
from outlast.errors import PreemptionError, TrainingFailedError
from outlast.protocol import messages as m
from outlast.protocol.kinds import Budget, FailureKind
from outlast.storage import records as r
from outlast.storage.run_store import RunStore
from tests.fakes.storage import MemoryStorage


def failure(rank=0, kind=None, message=None, exc_type="RuntimeError", attempt=1) -> r.FailureRecord:
    return r.FailureRecord(attempt=attempt, rank=rank, node_id="n", pid=10 + rank, exit_code=1, signal=None,
                           time=5.0, exc_type=exc_type, kind=kind, message=message)


def manifest(name: str, seq: int, attempt: int = 0) -> r.Manifest:
    return r.Manifest(checkpoint_dir=name, seq=seq, attempt=attempt, report_index=seq, committed_at=float(seq),
                      ranks=[0], files=[])


@pytest.fixture
def book() -> RunBook:
    b = RunBook.open(RunStore(MemoryStorage(), "run"), "exp", now=100.0)
    b.record_commit(manifest("ckpt_a", 1))
    b.record_commit(manifest("ckpt_b", 2))
    b.begin_attempt(101.0)
    b.state.attempts[-1].restored_from = "ckpt_b"
    return b


def state_of(book: RunBook) -> bytes:
    return msgspec.json.encode(book.state)


def judge(book: RunBook, failures, preemption=None, max_failures=3, history=None, **kw):
    attempt = book.state.attempts[-1].attempt
    before = state_of(book)
    history = [] if history is None else history
    was = list(history)
    verdict = judge_attempt(AttemptFacts.of(book, attempt), attempt, failures, history, preemption,
                            max_failures, 2, **kw)
    assert state_of(book) == before, "the verdict changed the history itself"
    assert history == was, "the verdict changed the list of earlier failures"
    return verdict


def test_a_users_failure_is_charged_to_max_failures_as_data_the_core_writes(book):
    root, other = failure(rank=1, message="boom"), failure(rank=0, exc_type=None)
    verdict = judge(book, [other, root])
    assert verdict.retry and verdict.error is None
    assert verdict.changes == (FailAttempt(root, Budget.WORKER),)
    assert verdict.blamed[0] is root and set(verdict.blamed) == {root, other}
    write_verdict(book, verdict, wall=102.0)
    current = book.state.attempts[-1]
    assert current.outcome == "failed" and current.ended_at == 102.0
    assert book.failures_this_launch(Budget.WORKER) == 1


def test_the_budget_spent_is_read_from_the_view_taken_before_the_verdict(book):
    history: list[r.FailureRecord] = []
    for n in range(3):
        verdict = judge(book, [failure()], max_failures=2, history=history)
        write_verdict(book, verdict, wall=102.0 + n)
        history += verdict.blamed
        book.begin_attempt(103.0 + n)
    assert not verdict.retry and isinstance(verdict.error, TrainingFailedError)
    assert len(verdict.error.failures) == 3  # every attempt's root cause, this one's included
    assert book.failures_this_launch(Budget.WORKER) == 3


def test_a_corrupt_restore_skips_the_checkpoint_it_restored_and_charges_no_worker_budget(book):
    bad = failure(kind=FailureKind.CORRUPT_CHECKPOINT, message="ckpt_b: checksum mismatch",
                  exc_type="CorruptCheckpointError")
    verdict = judge(book, [bad])
    assert verdict.retry
    assert verdict.changes == (FailAttempt(bad, Budget.CORRUPT_CHECKPOINT),
                               SkipRestored("ckpt_b", "ckpt_b: checksum mismatch"))
    write_verdict(book, verdict, wall=102.0)
    assert book.state.latest_checkpoint == "ckpt_a"
    assert [s.checkpoint_dir for s in book.state.skipped_checkpoints] == ["ckpt_b"]
    assert book.failures_this_launch(Budget.WORKER) == 0


def test_a_corrupt_restore_whose_checkpoint_is_gone_skips_nothing(book):
    book.forget_checkpoints({"ckpt_b"})
    bad = failure(kind=FailureKind.CORRUPT_CHECKPOINT, message="unreadable", exc_type="CorruptCheckpointError")
    verdict = judge(book, [bad])
    assert verdict.changes == (FailAttempt(bad, Budget.CORRUPT_CHECKPOINT),)


def test_a_set_up_failure_notes_its_reason_once_in_the_history(book):
    root = failure(rank=0, exc_type="RendezvousError", message="gloo could not connect")
    verdict = judge(book, [root], started={0, 1}, set_up=set())
    assert verdict.retry
    assert verdict.changes[0] == FailAttempt(root, Budget.SETUP)
    assert isinstance(verdict.changes[1], HistoryNote) and "attempt 1" in verdict.changes[1].text
    write_verdict(book, verdict, wall=102.0)
    write_verdict(book, verdict, wall=103.0)
    assert [n.text for n in book.state.notes].count(verdict.changes[1].text) == 1


def test_a_preemption_adds_its_own_failure_and_draws_on_the_preemption_budget(book):
    notice = m.NodeDraining(node_id="n", reason="spot", message="reclaimed", deadline_unix_s=0.0)
    preemption = Preemption.begin(notice, {0: "n"}, ["n"], [0], now=1.0, wall=101.5, grace_s=5.0)
    verdict = judge(book, [failure(exc_type=None)], preemption=preemption)
    assert verdict.retry
    assert [type(c) for c in verdict.changes] == [AddFailure, FailAttempt]
    assert verdict.changes[1] == FailAttempt(verdict.blamed[0], Budget.PREEMPTION)
    write_verdict(book, verdict, wall=102.0)
    assert book.state.attempts[-1].failures[0].kind is FailureKind.PREEMPTION
    assert book.failures_this_launch(Budget.PREEMPTION) == 1
    for n in range(2):
        book.begin_attempt(103.0 + n)
        verdict = judge(book, [], preemption=preemption)
        write_verdict(book, verdict, wall=104.0 + n)
    assert not verdict.retry and isinstance(verdict.error, PreemptionError)


def test_a_resize_ends_the_attempt_through_the_verdict_not_by_itself(book):
    resizes = Resizes(Elastic(1, 4, min_interval_s=0.0), since=0.0)
    lost = failure(exc_type=None, kind=FailureKind.NODE_LOST)
    before = state_of(book)
    verdict = resizes.end_if_resized(book, book.state.attempts[-1].attempt, 2, [lost], None, [3])
    assert verdict is not None and verdict.retry
    assert verdict.changes == (EndAttempt("resized"),)
    assert state_of(book) == before
    write_verdict(book, verdict, wall=102.0)
    assert book.state.attempts[-1].outcome == "resized"
    assert all(book.failures_this_launch(b) == 0 for b in Budget)
