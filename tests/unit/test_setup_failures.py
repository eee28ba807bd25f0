"""Which failed attempts are outlast's own set-up's, and the small budget they draw on instead of max_failures."""

from __future__ import annotations

import signal

from outlast.controller.setup_failures import SETUP_RETRIES, judge_setup
from outlast.protocol.kinds import Budget, FailureKind
from outlast.storage.records import FailureRecord

GLOO = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:40638"


def _f(rank, t=1.0, **kw) -> FailureRecord:
    base = dict(attempt=1, rank=rank, node_id="n", pid=100 + rank, exit_code=None, signal=None, time=t)
    return FailureRecord(**{**base, **kw})


def _rendezvous(rank, t=1.0) -> FailureRecord:
    return _f(rank, t, exit_code=1, exc_type="RendezvousError", phase="setup",
              message=f"rank {rank} of attempt 1 could not meet the other ranks in torch.distributed (gloo): {GLOO}")


def test_a_rendezvous_error_with_the_other_rank_ended_by_our_teardown_draws_on_the_setup_budget():
    decision = judge_setup([_rendezvous(0), _f(1, 2.0, signal=signal.SIGTERM)], started={0, 1}, set_up=set(),
                           so_far=0)
    assert decision.budget is Budget.SETUP
    assert "set-up failure 1 of 3" in decision.reason and "not counted against max_failures" in decision.reason


def test_a_rank_killed_before_its_setup_was_done_is_a_setup_failure():
    killed = _f(1, 1.0, signal=signal.SIGKILL)
    waiting = _f(0, 2.0, signal=signal.SIGKILL)  # ended by the teardown while it waited on rank 1
    assert judge_setup([killed, waiting], started={0, 1}, set_up=set(), so_far=0).budget is Budget.SETUP


def test_a_rank_killed_after_its_setup_was_done_is_charged_as_usual():
    assert judge_setup([_f(1, signal=signal.SIGKILL), _f(0, 2.0, signal=signal.SIGTERM)], started={0, 1}, set_up={0, 1},
                       so_far=0) is None


def test_a_users_exception_in_any_rank_makes_it_no_setup_failure():
    user = _f(1, 2.0, exit_code=1, exc_type="ValueError", message="bad batch", phase="train")
    assert judge_setup([_rendezvous(0), user], started={0, 1}, set_up={1}, so_far=0) is None
    in_setup = _f(1, 2.0, exit_code=1, exc_type="ValueError", message="bad shard", phase="setup")
    assert judge_setup([_rendezvous(0), in_setup], started={0, 1}, set_up=set(), so_far=0) is None


def test_a_lost_node_or_a_hang_is_never_a_setup_failure():
    lost = _f(1, kind=FailureKind.NODE_LOST, message="its agent is gone")
    assert judge_setup([_rendezvous(0), lost], started={0, 1}, set_up=set(), so_far=0) is None
    hang = _f(0, kind=FailureKind.HANG, message="no progress")
    assert judge_setup([hang], started={0, 1}, set_up=set(), so_far=0) is None


def test_only_symptoms_with_no_failure_in_setup_are_no_setup_failure():
    assert judge_setup([_f(0, signal=signal.SIGTERM), _f(1, signal=signal.SIGTERM)], started={0, 1},
                       set_up={0, 1}, so_far=0) is None
    assert judge_setup([], started={0, 1}, set_up=set(), so_far=0) is None


def test_past_its_budget_a_setup_failure_is_charged_to_max_failures_saying_so():
    decision = judge_setup([_rendezvous(0)], started={0, 1}, set_up=set(), so_far=SETUP_RETRIES)
    assert decision.budget is Budget.WORKER
    assert "more than its 3 retries" in decision.reason and "counted against max_failures" in decision.reason


def test_a_rank_that_died_before_its_hello_is_charged_as_before():
    """Killed in its fork or importing the train function's module: nothing says it reached outlast's set-up."""
    assert judge_setup([_f(1, signal=signal.SIGKILL), _f(0, 2.0, signal=signal.SIGTERM)], started={0}, set_up=set(),
                       so_far=0) is None
