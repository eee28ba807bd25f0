import pytest

from outlast.controller.policy import FailureDecision, decide_on_failure, pick_root_cause
from outlast.storage.records import FailureRecord


def failure(**kw) -> FailureRecord:
    base = dict(attempt=2, rank=3, node_id="n1", pid=42, exit_code=1, signal=None, time=0.0)
    return FailureRecord(**{**base, **kw})


def test_max_failures_zero_raises_on_the_first_failure():
    d = decide_on_failure(failure(), failures_so_far=0, max_failures=0)
    assert d.action is FailureDecision.RAISE
    assert "1 failures exceed FailureConfig(max_failures=0)" in d.reason


@pytest.mark.parametrize("so_far", [0, 1, 100])
def test_max_failures_minus_one_always_restarts(so_far):
    d = decide_on_failure(failure(), failures_so_far=so_far, max_failures=-1)
    assert d.action is FailureDecision.RESTART
    assert f"failure {so_far + 1}, max_failures=-1 retries forever" in d.reason


def test_restarts_while_earlier_failures_are_below_the_budget():
    d = decide_on_failure(failure(), failures_so_far=1, max_failures=2)
    assert d.action is FailureDecision.RESTART
    assert "failure 2 of max_failures=2" in d.reason


def test_raises_once_earlier_failures_reach_the_budget():
    d = decide_on_failure(failure(), failures_so_far=2, max_failures=2)
    assert d.action is FailureDecision.RAISE
    assert "3 failures exceed FailureConfig(max_failures=2)" in d.reason


def test_reason_starts_with_the_exception_when_the_worker_raised():
    d = decide_on_failure(failure(exc_type="KeyError", message="'x'"), 0, 1)
    assert d.reason.startswith("rank 3 (pid 42, node n1, attempt 2) raised KeyError: 'x'")


def test_reason_names_the_signal_when_the_worker_was_killed():
    d = decide_on_failure(failure(exit_code=None, signal=9), 0, 1)
    assert "was killed by SIGKILL" in d.reason


def test_an_unknown_signal_number_is_shown_as_a_number():
    assert "killed by signal 200" in failure(exit_code=None, signal=200).describe()


def test_reason_names_the_exit_code_when_there_is_neither_exception_nor_signal():
    assert "exited with code 7" in decide_on_failure(failure(exit_code=7), 0, 1).reason


def _f(rank, t, **kw):
    base = dict(attempt=1, rank=rank, node_id="n", pid=100 + rank, exit_code=None, signal=None, time=t)
    base.update(kw)
    return FailureRecord(**base)


def test_a_sigkilled_worker_is_the_root_cause_even_when_its_peer_is_reaped_first():
    peer = _f(0, 1.0, exit_code=1, exc_type="RuntimeError",
              message="[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    killed = _f(1, 2.0, signal=9)
    assert pick_root_cause([peer, killed]) is killed


def test_a_users_exception_outranks_a_death_by_signal_and_our_own_sigterm():
    user = _f(2, 3.0, exit_code=1, exc_type="ValueError", message="bad batch")
    assert pick_root_cause([_f(0, 1.0, signal=15), _f(1, 2.0, signal=11), user]) is user


def test_our_own_sigterm_is_blamed_only_when_nothing_else_is_there():
    first, second = _f(0, 1.0, signal=15), _f(1, 2.0, signal=15)
    assert pick_root_cause([second, first]) is first


def test_pick_root_cause_needs_a_failure():
    with pytest.raises(ValueError):
        pick_root_cause([])
