"""Drains one step off the tested path, driven in-process: an interrupt or a lost lease during one,
a failure during one, a drain during a grow, several nodes drained at once, and whom a hang blames."""

from __future__ import annotations

import logging

import pytest

from outlast.controller import group as g
from outlast.controller.resize import Elastic
from outlast.controller.states import State
from outlast.protocol import messages as m
from outlast.protocol.kinds import FailureKind
from tests.fakes.controller import make, node, start


def drain(h, node_id, deadline_s=60.0, node_ids=()):
    deadline = h.wall() + deadline_s if deadline_s is not None else None
    return h.agent(node_id, m.NodeDraining(node_id=node_id, reason="preemption", message="reclaimed",
                                           deadline_unix_s=deadline, node_ids=list(node_ids) or [node_id]))


def ask(h, rank, index):
    h.worker(m.PreemptionQuery(attempt=h.core.attempt.number, rank=rank, index=index))
    return [x for x in h.to_rank(rank) if isinstance(x, (m.PreemptionGrant, m.PreemptionNotice)) and x.index == index]


def notices(h, rank):
    return [x for x in h.to_rank(rank) if isinstance(x, m.PreemptionNotice)]


def failed(h, rank, node_id, exc_type, message="", traceback=""):
    return h.agent(node_id, m.WorkerExited(
        run_id=h.core.run_id, attempt=h.core.attempt.number, rank=rank, pid=100 + rank, exit_code=1, signal=None,
        node_id=node_id, error=m.WorkerError(exc_type=exc_type, message=message, traceback=traceback, phase="train")))


def stopped(h, placement, ranks):
    for rank in ranks:
        h.agent(placement[rank], m.WorkerExited(run_id=h.core.run_id, attempt=h.core.attempt.number, rank=rank,
                                                pid=100 + rank, exit_code=None, signal=15, error=None,
                                                node_id=placement[rank]))


# ---- an interrupt or a lost lease during a drain (item 7) ----------------------------------


@pytest.mark.parametrize("stop", [g.Interrupted(), g.LeaseLost("the lease was taken over")], ids=["ctrl-c", "lease"])
def test_a_query_after_a_drain_is_cut_short_gets_the_notice_and_nothing_raises(stop):
    h = make()
    placement = start(h)
    for rank in (0, 1):
        ask(h, rank, 0)  # one-call grants: the notice is fixed at once for the next call
    drain(h, placement[0])
    assert h.state is State.PREEMPTING
    h.step(stop)
    assert h.state.is_terminal
    answers = ask(h, 0, 1)
    assert [type(x) for x in answers] == [m.PreemptionNotice]
    assert answers[0].ranks == [0] and answers[0].decision_index == 1


@pytest.mark.parametrize("stop", [g.Interrupted(), g.LeaseLost("the lease was taken over")], ids=["ctrl-c", "lease"])
def test_a_query_that_waits_for_a_decision_when_the_run_stops_is_answered(stop):
    h = make()
    placement = start(h)
    for index in range(40):  # a fast loop: grants of many calls, so the decision waits for every rank
        for rank in (0, 1):
            ask(h, rank, index)
        h.step(dt=0.001)
    drain(h, placement[0])
    h.step(dt=1.0)  # the grants expire: the next asker is parked until the other asks
    assert ask(h, 0, 80) == []  # parked
    h.step(stop)
    h.step(dt=0.1)
    answers = [x for x in h.to_rank(0) if isinstance(x, m.PreemptionNotice) and x.index == 80]
    assert len(answers) == 1  # the same decision every rank gets: the rank goes on, and hears it there


# ---- a failure during a drain is charged to its cause (item 8) ------------------------------


def test_a_users_error_on_a_node_not_drained_fails_a_run_without_retries(caplog):
    h = make(max_failures=0)
    placement = start(h)
    drain(h, placement[0])
    with caplog.at_level(logging.WARNING, logger="outlast.controller"):
        failed(h, 1, placement[1], "ZeroDivisionError", "division by zero",
               'Traceback (most recent call last):\n  File "train.py", line 3\nZeroDivisionError: division by zero\n')
        stopped(h, placement, [0])
    assert h.state is State.ERRORED, "a user's exception during a drain restarted a run with max_failures=0"
    assert "ZeroDivisionError" in str(h.core.error)
    assert "max_failures=0" in str(h.core.error)
    assert 'File "train.py", line 3' in caplog.text
    assert [a.outcome for a in h.core.book.state.attempts] == ["failed"]


def test_a_users_error_during_a_drain_draws_on_max_failures_not_the_preemption_budget():
    h = make(max_failures=1, max_preemption_failures=5)
    placement = start(h)
    drain(h, placement[0])
    failed(h, 1, placement[1], "ZeroDivisionError", "division by zero")
    stopped(h, placement, [0])
    assert h.core.attempt.number == 2
    assert h.core.book.failures_this_launch("worker") == 1
    assert h.core.book.failures_this_launch("preemption") == 0


def test_another_nodes_loss_during_a_drain_draws_on_max_failures():
    h = make(max_failures=0, nodes=("n1", "n2", "n3"))
    placement = start(h)
    drain(h, placement[0])
    h.step(g.AgentGone(placement[1], "the agent of n2 died"))
    h.step(dt=0.2)
    stopped(h, placement, [0])
    assert h.state is State.ERRORED and h.core.error.failures[0].kind is FailureKind.NODE_LOST


def test_a_hang_during_a_drain_draws_on_max_failures():
    h = make(max_failures=0, hang_timeout_s=10.0)
    placement = start(h)
    drain(h, placement[0], deadline_s=3600.0)
    h.step(dt=11.0)  # no progress from any rank: a hang
    for rank in (0, 1):
        h.worker(m.StackDump(attempt=1, rank=rank, where="train.py:7 in step", text="stack"))
    stopped(h, placement, [0, 1])
    assert h.state is State.ERRORED and "Hang" in str(h.core.error)


def test_a_drained_nodes_own_loss_is_still_the_preemption():
    h = make(max_failures=0, max_preemption_failures=1)
    placement = start(h)
    drain(h, placement[0])
    h.step(g.AgentGone(placement[0], "the agent of n1 died"))
    h.step(dt=0.2)
    stopped(h, placement, [1])
    assert h.core.attempt.number == 2 and h.core.book.failures_this_launch("preemption") == 1


# ---- a drain during a grow (item 10) -----------------------------------------------------------


def test_a_drain_without_a_deadline_during_a_pending_grow_reaches_the_ranks():
    h = make(world_size=2, nodes=("n1", "n2"), elastic=Elastic(1, 3, min_interval_s=0.0))
    placement = start(h)
    for rank in (0, 1):
        ask(h, rank, 0)
    h.step(g.NodeTable([node(n) for n in ("n1", "n2", "n3")]))  # room for a third worker: a grow notice
    assert h.state is State.PREEMPTING
    drain(h, placement[0], deadline_s=None)
    answers = {r: ask(h, r, 1) for r in (0, 1)}
    seen = {r: [(x.reason, x.ranks) for x in a if isinstance(x, m.PreemptionNotice)] for r, a in answers.items()}
    assert seen == {0: [("preemption", [0])], 1: [("preemption", [0])]}


# ---- several nodes drained at once (item 13) ---------------------------------------------------


def test_nodes_drained_one_after_another_before_any_rank_asks_make_one_notice_naming_all():
    h = make(world_size=3, nodes=("n1", "n2", "n3"))
    placement = start(h)
    for rank in range(3):
        ask(h, rank, 0)
    for n in ("n1", "n2", "n3"):  # a whole Slurm job: USR1 drains every node of it
        drain(h, n)
    seen = {r: [(x.node_ids, x.ranks) for x in ask(h, r, 1)] for r in range(3)}
    assert seen == {r: [(["n1", "n2", "n3"], [0, 1, 2])] for r in range(3)}
    assert notices(h, 0)[0].node_to_ranks == {n: [r] for r, n in placement.items()}


def test_one_drain_naming_several_nodes_is_one_notice_naming_all():
    h = make(world_size=3, nodes=("n1", "n2", "n3"))
    start(h)
    for rank in range(3):
        ask(h, rank, 0)
    drain(h, "n1", node_ids=("n1", "n2"))
    assert [(x.node_ids, x.ranks) for x in ask(h, 2, 1)] == [(["n1", "n2"], [0, 1])]


# ---- a hang is blamed on the rank that is wedged (item 13) -----------------------------------


def test_a_hang_is_blamed_on_the_rank_elsewhere_than_the_collective_the_others_wait_in():
    h = make(world_size=3, nodes=("n1", "n2", "n3"), hang_timeout_s=10.0)
    placement = start(h)
    h.step(dt=11.0)
    for rank in (0, 2):
        h.worker(m.StackDump(attempt=1, rank=rank, where="torch/distributed.py:10 in all_reduce", text="a"))
    h.worker(m.StackDump(attempt=1, rank=1, where="train.py:42 in load_batch", text="b"))
    record = h.core.attempt.failures[0]
    assert record.kind is FailureKind.HANG and record.exc_type is None and record.rank == 1 and record.node_id == placement[1]
    assert "rank 1 is in train.py:42" in record.message


def test_a_hang_is_blamed_on_the_rank_that_sent_no_stacks():
    h = make(world_size=3, nodes=("n1", "n2", "n3"), hang_timeout_s=10.0)
    start(h)
    h.step(dt=11.0)
    for rank in (0, 1):
        h.worker(m.StackDump(attempt=1, rank=rank, where="torch/distributed.py:10 in all_reduce", text="a"))
    h.step(dt=11.0)  # rank 2 never answers
    assert h.core.attempt.failures[0].rank == 2


# ---- a drain until the commit holds the ranks once its checkpoint is committed (item 13) -------------


ENTRY = m.FileEntry("model.pt", 1, "0" * 64)


def _jit_report(h, rank, index, checkpoint):
    h.worker(m.Report(attempt=h.core.attempt.number, rank=rank, index=index, metrics={"step": index},
                      checkpoint_dir=f"checkpoint_001_{index:06d}" if checkpoint else None,
                      files=[ENTRY] if checkpoint else [], saw_preemption=True))


def test_a_drain_until_the_commit_holds_the_ranks_once_the_checkpoint_is_committed():
    h = make(nodes=("n1", "n2"), max_preemption_failures=-1)
    placement = start(h)
    for rank in (0, 1):
        ask(h, rank, 0)
    h.agent("n1", m.NodeDraining(node_id="n1", reason="preemption", message="Slurm job 7 got SIGUSR1",
                                 deadline_unix_s=h.wall() + 30.0, node_ids=["n1", "n2"], until_commit=True))
    for rank in (0, 1):
        assert [(x.node_ids, x.ranks) for x in ask(h, rank, 1)] == [(["n1", "n2"], [0, 1])]
    _jit_report(h, 0, 0, checkpoint=True)
    _jit_report(h, 1, 0, checkpoint=False)
    assert h.core.book.state.latest_checkpoint == "checkpoint_001_000000"
    assert not [x for r in (0, 1) for x in h.to_rank(r) if isinstance(x, m.Committed)]
    h.agent("n1", m.NodeDraining(node_id="n1", reason="preemption", message="requeued", deadline_unix_s=h.wall(),
                                 node_ids=["n1", "n2"], until_commit=True))
    h.step(dt=0.1)
    assert h.state is State.RESTARTING
    stopped(h, placement, [0, 1])
    assert h.core.book.failures_this_launch("preemption") == 1 and h.core.book.failures_this_launch("worker") == 0


def test_only_the_checkpoint_saved_for_the_drain_is_the_commit_a_requeue_waits_for():
    # Seen on Slurm: a checkpoint every 10 steps of 50 ms, one reported before the ranks heard of the drain
    # committed 0.2 s after it, the job was requeued on that commit, and the steps since were lost.
    from outlast.controller.heartbeat import heartbeat

    h = make(nodes=("n1", "n2"), max_preemption_failures=-1)
    start(h)
    for rank in (0, 1):
        ask(h, rank, 0)
    h.agent("n1", m.NodeDraining(node_id="n1", reason="preemption", message="Slurm job 7 got SIGUSR1",
                                 deadline_unix_s=h.wall() + 55.0, node_ids=["n1", "n2"], until_commit=True))
    for rank in (0, 1):  # the loop's periodic checkpoint, reported before it asked again
        h.worker(m.Report(attempt=1, rank=rank, index=0, metrics={"step": 9},
                          checkpoint_dir="checkpoint_001_000000" if rank == 0 else None,
                          files=[ENTRY] if rank == 0 else []))
    assert h.core.book.state.latest_checkpoint == "checkpoint_001_000000"
    assert heartbeat(h.core).last_commit_at is not None and heartbeat(h.core).saved_for_drain_at is None
    for rank in (0, 1):
        ask(h, rank, 1)
    _jit_report(h, 0, 1, checkpoint=True)
    _jit_report(h, 1, 1, checkpoint=False)
    assert h.state is State.SAVED
    beat = heartbeat(h.core)
    assert beat.saved_for_drain_at == h.core.book.state.checkpoints[-1].committed_at
    assert h.core.book.state.checkpoints[-1].checkpoint_dir == "checkpoint_001_000001"


def test_without_until_the_commit_a_saved_run_with_nowhere_to_go_trains_on():
    h = make(nodes=("n1", "n2"))
    start(h)
    for rank in (0, 1):
        ask(h, rank, 0)
    h.agent("n1", m.NodeDraining(node_id="n1", reason="preemption", message="spot", deadline_unix_s=h.wall() + 30.0,
                                 node_ids=["n1", "n2"]))
    for rank in (0, 1):
        ask(h, rank, 1)
    _jit_report(h, 0, 0, checkpoint=True)
    _jit_report(h, 1, 0, checkpoint=False)
    assert h.state is State.SAVED
    assert [x.index for x in h.to_rank(0) if isinstance(x, m.Committed)] == [0]


# ---- the teardown of a preempted attempt ------------------------------------------------------


def _killed(h, rank, node_id, sig=9, error=None):
    return h.agent(node_id, m.WorkerExited(run_id=h.core.run_id, attempt=h.core.attempt.number, rank=rank,
                                           pid=100 + rank, exit_code=None, signal=sig, error=error, node_id=node_id))


def _saved_and_restarting(h, placement):
    """Both ranks started, node 0 drains, the just-in-time checkpoint commits, and the attempt restarts."""
    for rank in (0, 1):
        h.agent(placement[rank], m.WorkerStarted(run_id=h.core.run_id, attempt=1, rank=rank, pid=100 + rank))
        ask(h, rank, 0)
    drain(h, placement[0], deadline_s=30.0)
    for rank in (0, 1):
        ask(h, rank, 1)
    _jit_report(h, 0, 0, checkpoint=True)
    _jit_report(h, 1, 0, checkpoint=False)
    assert h.state is State.RESTARTING and h.core.book.state.latest_checkpoint == "checkpoint_001_000000"


def test_a_sigkill_before_the_stops_grace_is_over_is_not_the_stop_but_a_failure_of_its_own():
    """Sim seed 1561: a rank killed -9 by someone else while the attempt is being stopped."""
    h = make(nodes=("n1", "n2", "n3"), max_failures=2, max_preemption_failures=5)
    placement = start(h)
    _saved_and_restarting(h, placement)
    _killed(h, 1, placement[1], sig=9)  # at once: the agent sends SIGKILL only once the grace is over
    _killed(h, 0, placement[0], sig=15)
    assert h.core.attempt.number == 2
    assert h.core.book.failures_this_launch("worker") == 1 and h.core.book.failures_this_launch("preemption") == 0


def test_a_sigkill_of_a_rank_born_after_the_stop_is_the_stop():
    """Its agent kills it at once, and never told it started (sim seed 5762)."""
    h = make(nodes=("n1", "n2", "n3"), max_failures=0, max_preemption_failures=5)
    placement = start(h)
    drain(h, placement[0], deadline_s=0.0)
    h.step(dt=0.2)
    assert h.state is State.RESTARTING
    _killed(h, 1, placement[1], sig=9)
    _killed(h, 0, placement[0], sig=15)
    assert h.core.attempt.number == 2 and h.core.book.failures_this_launch("worker") == 0


def test_a_sigkill_once_the_stops_grace_is_over_is_the_stop():
    h = make(nodes=("n1", "n2", "n3"), max_failures=0, max_preemption_failures=5)
    placement = start(h)
    _saved_and_restarting(h, placement)
    h.step(dt=h.core.plan.timeouts.teardown_grace_s)
    _killed(h, 1, placement[1], sig=9)
    _killed(h, 0, placement[0], sig=15)
    assert h.core.attempt.number == 2 and h.core.book.failures_this_launch("preemption") == 1


def test_a_rank_no_stop_could_end_on_a_node_not_drained_is_charged_to_max_failures():
    """Sim seed 799: stuck in the kernel, given up by its node after the drain's checkpoint was committed."""
    h = make(nodes=("n1", "n2", "n3"), max_failures=2, max_preemption_failures=5)
    placement = start(h)
    _saved_and_restarting(h, placement)
    _killed(h, 0, placement[0], sig=15)
    h.step(dt=30.0)
    _killed(h, 1, placement[1], error=m.WorkerError(kind=FailureKind.UNKILLABLE, message="pid 101 did not die",
                                                    traceback="", phase="node"))
    assert h.core.attempt.number == 2
    assert h.core.book.failures_this_launch("worker") == 1 and h.core.book.failures_this_launch("preemption") == 0
