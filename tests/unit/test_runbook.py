import pytest

from outlast.controller.runstate import RunBook
from outlast.protocol.messages import FileEntry
from outlast.storage import records as r
from outlast.storage.run_store import RunStore
from tests.fakes.storage import MemoryStorage

STATE = "run/run_state.json"


@pytest.fixture
def mem():
    return MemoryStorage()


@pytest.fixture
def book(mem):
    return RunBook.open(RunStore(mem, "run"), "exp", now=100.0)


def failure(time=5.0, rank=0) -> r.FailureRecord:
    return r.FailureRecord(attempt=1, rank=rank, node_id="n", pid=1, exit_code=1, signal=None, time=time)


def saved(book) -> r.RunState:
    """The state as storage holds it once the book's changes are written (the core hands them to storage)."""
    book.flush()
    mem = book.store.storage
    return r.decode(mem.files[STATE], r.RunState, STATE)


def commit(book, name, now=10.0, metrics=None):
    seq = max((c.seq for c in book.state.checkpoints), default=0) + 1
    book.record_commit(r.Manifest(checkpoint_dir=name, seq=seq, attempt=1, report_index=0, committed_at=now,
                                  ranks=[0], files=[FileEntry("m", 1, "0" * 64)], metrics=metrics or {}))


def test_opening_a_new_run_starts_initializing_and_writes_nothing(mem, book):
    assert (book.state.name, book.state.status, book.state.created_at) == ("exp", "initializing", 100.0)
    assert mem.ops == []


def test_attempts_are_numbered_from_one(mem, book):
    assert book.begin_attempt(now=1.0) == 1
    assert book.begin_attempt(now=2.0) == 2
    assert [a.attempt for a in saved(book).attempts] == [1, 2]
    assert saved(book).status == "running"


def test_attempt_numbering_continues_from_a_loaded_state(mem, book):
    book.begin_attempt(1.0)
    book.begin_attempt(2.0)
    book.flush()  # what the core hands to storage, written
    reopened = RunBook.open(RunStore(mem, "run"), "ignored", now=50.0)
    assert reopened.state.created_at == 100.0
    assert reopened.begin_attempt(3.0) == 3


def test_an_attempt_restores_from_the_latest_checkpoint(book):
    book.begin_attempt(1.0)
    commit(book, "c1")
    book.begin_attempt(2.0)
    assert [a.restored_from for a in book.state.attempts] == [None, "c1"]


def test_end_attempt_records_the_outcome_only_once(mem, book):
    book.begin_attempt(1.0)
    book.end_attempt("finished", now=2.0)
    book.end_attempt("aborted", now=3.0)
    attempt = saved(book).attempts[0]
    assert (attempt.ended_at, attempt.outcome) == (2.0, "finished")
    assert saved(book).updated_at == 3.0


def test_settling_a_failed_attempt_counts_it_ends_it_and_puts_the_root_cause_first(mem, book):
    book.begin_attempt(1.0)
    bystander, root = failure(rank=0, time=4.0), failure(rank=1, time=5.0)
    book.add_failure(bystander)
    book.add_failure(root)
    book.fail_attempt(root, "worker", now=6.0)
    state = saved(book)
    assert state.failure_counts == {"worker": 1}
    assert (state.attempts[0].ended_at, state.attempts[0].outcome) == (6.0, "failed")
    assert [f.rank for f in state.attempts[0].failures] == [1, 0]


def test_failure_counts_accumulate_across_attempts(book):
    for n in range(3):
        book.begin_attempt(float(n))
        book.add_failure(failure())
        book.fail_attempt(book.state.attempts[-1].failures[0], "worker", now=float(n))
    assert book.state.failure_counts == {"worker": 3}


def test_a_recorded_failure_is_neither_counted_nor_ending_the_attempt_until_it_fails(book):
    book.begin_attempt(1.0)
    book.add_failure(failure(rank=1))
    assert book.state.failure_counts == {}
    assert book.state.attempts[0].failures == [failure(rank=1)]
    assert book.state.attempts[0].outcome is None


def test_a_relaunched_driver_gets_its_failure_budget_anew(mem, book):
    book.begin_attempt(1.0)
    book.add_failure(failure())
    book.fail_attempt(failure(), "worker", now=2.0)
    book.flush()
    relaunched = RunBook.open(book.store, "run", now=3.0)
    assert relaunched.state.failure_counts == {"worker": 1}
    assert relaunched.failures_this_launch("worker") == 0


def test_a_dead_drivers_open_attempt_is_closed_without_charging_the_worker_budget(mem, book):
    book.begin_attempt(1.0)
    book.flush()
    relaunched = RunBook.open(book.store, "run", now=9.0)
    assert relaunched.close_dead_drivers_attempt(now=9.0, last_seen=7.5)
    attempt = relaunched.state.attempts[-1]
    assert (attempt.ended_at, attempt.outcome) == (7.5, "driver_lost")
    assert relaunched.state.failure_counts == {"driver": 1}
    assert relaunched.failures_this_launch("driver") == 0
    assert not relaunched.close_dead_drivers_attempt(now=10.0, last_seen=None)


def test_forget_checkpoints_drops_only_the_named_records(mem, book):
    for name in ("a", "b", "c"):
        commit(book, name)
    book.forget_checkpoints({"a", "c", "never-existed"})
    assert [c.checkpoint_dir for c in saved(book).checkpoints] == ["b"]


def test_finish_writes_status_and_error(mem, book):
    book.finish("errored", error="boom")
    assert (saved(book).status, saved(book).error) == ("errored", "boom")


def test_an_attempt_keeps_the_window_it_waited_for_capacity(book):
    book.begin_attempt(now=1.0)
    book.set_waiting("no node has 2 CPU free", now=2.0)
    book.set_waiting("no node has 2 CPU free", now=3.0)  # a later try of the same wait: still from 2.0
    assert saved(book).attempts[0].waiting_since == 2.0 and saved(book).attempts[0].capacity_at is None
    book.set_waiting(None, now=7.5)
    a = saved(book).attempts[0]
    assert (a.waiting_since, a.capacity_at) == (2.0, 7.5)
    book.begin_attempt(now=8.0)
    book.set_waiting(None, now=8.5)  # placed without waiting: no window
    assert (saved(book).attempts[1].waiting_since, saved(book).attempts[1].capacity_at) == (None, None)
