"""What Slurm's signals and node states become: drains with deadlines, requeues, or nothing."""

from __future__ import annotations

import signal

from outlast.slurm.policy import (
    AfterDrain, after_drain, deadline_from_reason, failure_domain, on_node_states, on_signal,
)
from outlast.slurm.scontrol import JobInfo, NodeState

NOW = 1_000_000.0


def job(**kw) -> JobInfo:
    base = dict(job_id="42", state="RUNNING", partition="low", restarts=1, end_time=None, preempt_time=None)
    return JobInfo(**{**base, **kw})


def test_usr1_at_preemption_drains_every_node_until_the_grace_time_ends_and_requeues():
    order = on_signal(signal.SIGUSR1, job(preempt_time=NOW - 2), 30.0, ["n1", "n2"], 1, NOW)
    assert order is not None
    assert order.node_ids == ["n1", "n2"] and order.reason == "preemption" and order.requeue
    assert order.deadline_s == 28.0
    assert "Slurm job 42 (restart 1) got SIGUSR1" in order.message and "preempted" in order.message


def test_usr1_before_the_time_limit_has_the_time_limit_as_deadline():
    order = on_signal(signal.SIGUSR1, job(end_time=NOW + 55), 30.0, ["n1"], 0, NOW)
    assert order is not None and order.deadline_s == 55.0 and "time limit" in order.message


def test_a_deadline_already_past_is_now_and_usr1_by_hand_has_none():
    assert on_signal(signal.SIGUSR1, job(end_time=NOW - 5), 0.0, ["n1"], 0, NOW).deadline_s == 0.0
    assert on_signal(signal.SIGUSR1, job(), 0.0, ["n1"], 0, NOW).deadline_s is None


def test_sigterm_is_a_cancel_not_a_preemption():
    assert on_signal(signal.SIGTERM, job(preempt_time=NOW), 30.0, ["n1"], 0, NOW) is None


def node(name, states, reason="", set_at=None) -> NodeState:
    return NodeState(name=name, states=frozenset(states), reason=reason, reason_set_at=set_at)


def test_a_node_of_the_job_drained_by_slurm_is_drained_once_for_maintenance():
    states = [node("n1", {"ALLOCATED"}), node("n2", {"ALLOCATED", "DRAIN"}, "disk swap"),
              node("n3", {"IDLE", "DRAIN"}, "not ours")]
    (order,) = on_node_states(states, ["n1", "n2"], set(), "42", 3, NOW)
    assert order.node_ids == ["n2"] and order.reason == "maintenance" and order.deadline_s is None
    assert "disk swap" in order.message and "Slurm job 42 (restart 3)" in order.message
    assert on_node_states(states, ["n1", "n2"], {"n2"}, "42", 3, NOW) == []


def test_a_deadline_in_the_reason_counts_from_when_it_was_set():
    assert deadline_from_reason("maintenance deadline=300", NOW - 100, NOW) == 200.0
    assert deadline_from_reason("reboot in 5m", None, NOW) == 300.0
    assert deadline_from_reason("going away in 2 hours", NOW, NOW) == 7200.0
    assert deadline_from_reason("deadline: 10s", NOW - 60, NOW) == 0.0
    assert deadline_from_reason("bad DIMM", NOW, NOW) is None


def test_failure_domain_from_a_feature_prefix():
    assert failure_domain(["ib", "rack_a"], "rack_") == "rack_a"
    assert failure_domain(["ib"], "rack_") == ""
    assert failure_domain(["rack_a"], "") == ""


def seen(**kw) -> AfterDrain:
    base = dict(now=NOW, drained_at=NOW - 5, drained=frozenset({"n1", "n2"}), job_nodes=frozenset({"n1", "n2"}),
                had_workers=True, workers_on=frozenset({"n1"}), drain_saves=(), idle_since=None, deadline=NOW + 60)
    return AfterDrain(**{**base, **kw})


def test_with_every_node_drained_the_job_is_requeued_once_the_checkpoint_is_committed():
    assert after_drain(seen(drain_saves=(NOW - 10,)))[0] == "wait"  # committed before the drain: not the one
    verdict, why = after_drain(seen(drain_saves=(NOW - 10, NOW - 1)))
    assert verdict == "requeue" and "committed" in why
    assert after_drain(seen(workers_on=frozenset()))[0] == "requeue"  # the run stopped for the drain


def test_near_slurms_deadline_the_job_is_requeued_committed_or_not():
    verdict, why = after_drain(seen(deadline=NOW + 2))
    assert verdict == "requeue" and "deadline" in why


def test_a_drain_that_found_no_workers_requeues_at_once():
    assert after_drain(seen(had_workers=False, workers_on=frozenset()))[0] == "requeue"


def test_a_run_that_moved_to_the_nodes_left_goes_on_without_a_requeue():
    partial = dict(drained=frozenset({"n1"}), job_nodes=frozenset({"n1", "n2", "n3"}))
    assert after_drain(seen(**partial, workers_on=frozenset({"n1"})))[0] == "wait"
    verdict, why = after_drain(seen(**partial, workers_on=frozenset({"n2", "n3"})))
    assert verdict == "moved" and "n2, n3" in why
    # Between attempts for a moment: wait; without workers for a while: it waits for capacity, requeue.
    assert after_drain(seen(**partial, workers_on=frozenset(), idle_since=NOW - 1))[0] == "wait"
    assert after_drain(seen(**partial, workers_on=frozenset(), idle_since=NOW - 4))[0] == "requeue"
