"""What Slurm's signals and node states become: drains with deadlines, requeues, or nothing."""

from __future__ import annotations

import signal

from outlast.slurm.policy import committed_since, deadline_from_reason, failure_domain, on_node_states, on_signal
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


def test_requeue_waits_for_a_commit_after_the_drain():
    assert not committed_since([NOW - 1], NOW)
    assert committed_since([NOW - 1, NOW + 0.5], NOW)
