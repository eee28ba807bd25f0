"""The node agent's supervisor, driven in-process on a fake clock: no sockets, no processes."""

from __future__ import annotations

import signal

from outlast.agent.supervisor import ExpectedWorkload, Kill, ReleaseLeaf, Send, Supervisor, Warn
from outlast.protocol.kinds import WorkloadKind
from outlast.protocol import messages as m
from outlast.protocol.kinds import FailureKind

CTRL = b"controller-1"


def forked(pid: int, run_id: str = "r1", attempt: int = 1, rank: int = 0, task_id: str = "") -> m.Forked:
    return m.Forked(run_id=run_id, attempt=attempt, rank=rank, pid=pid, task_id=task_id)


def reaped(pid: int, run_id: str = "r1", attempt: int = 1, rank: int = 0, exit_code: int | None = 0,
           sig: int | None = None, task_id: str = "") -> m.Reaped:
    return m.Reaped(run_id=run_id, attempt=attempt, rank=rank, pid=pid, exit_code=exit_code, signal=sig, error=None,
                    task_id=task_id)


def kills(effects) -> list[tuple[int, int]]:
    return [(e.pid, e.sig) for e in effects if isinstance(e, Kill)]


def sent(effects) -> list[m.Msg]:
    return [e.msg for e in effects if isinstance(e, Send)]


def running(sup: Supervisor, pids: list[int], now: float = 0.0, timeout_s: float = 5.0, attempt: int = 1) -> None:
    sup.heartbeat(CTRL, m.RunHeartbeat(run_id="r1", timeout_s=timeout_s), now)
    sup.admit(CTRL, "r1", now)
    for rank, pid in enumerate(pids):
        sup.expect(("r1", attempt, rank, ""), ExpectedWorkload(world_size=len(pids), demand={"CPU": 1.0}))
        sup.on_forked(forked(pid, attempt=attempt, rank=rank), wall=1000.0)


def test_a_spawned_worker_is_announced_to_its_controller_and_holds_its_demand():
    sup = Supervisor("n1")
    sup.heartbeat(CTRL, m.RunHeartbeat(run_id="r1", timeout_s=5.0), 0.0)
    sup.expect(("r1", 1, 0, ""), ExpectedWorkload(world_size=2, demand={"CPU": 1.0}))
    effects = sup.on_forked(forked(101), wall=1000.0)
    assert effects == [Send(CTRL, m.WorkerStarted(run_id="r1", attempt=1, rank=0, pid=101))]
    assert sup.usage() == {"r1": {"CPU": 1.0}}
    assert sup.workloads[101].world_size == 2 and sup.workloads[101].started_at == 1000.0


def test_an_exit_is_reported_with_its_status_and_frees_the_leaf():
    sup = Supervisor("n1")
    running(sup, [101])
    effects = sup.on_reaped(reaped(101, exit_code=None, sig=signal.SIGKILL))
    assert ReleaseLeaf(101, None) in effects
    (msg,) = sent(effects)
    assert isinstance(msg, m.WorkerExited) and msg.signal == signal.SIGKILL and msg.node_id == "n1"
    assert sup.workloads == {} and sup.usage() == {}


def test_a_task_exit_is_reported_as_a_task():
    sup = Supervisor("n1")
    sup.admit(CTRL, "exec", 0.0)
    sup.expect(("exec", 0, -1, "t1"), ExpectedWorkload(retriable=False))
    assert sup.on_forked(forked(7, run_id="exec", attempt=0, rank=-1, task_id="t1"), wall=5.0) == []
    (msg,) = sent(sup.on_reaped(reaped(7, run_id="exec", attempt=0, rank=-1, task_id="t1")))
    assert isinstance(msg, m.TaskExited) and msg.task_id == "t1"


def test_a_silent_driver_loses_its_workers_after_its_timeout_not_before():
    sup = Supervisor("n1")
    running(sup, [101, 102], timeout_s=5.0)
    assert sup.tick(4.9) == []
    effects = sup.tick(5.1)
    assert sorted(kills(effects)) == [(101, signal.SIGKILL), (102, signal.SIGKILL)]
    assert any(isinstance(e, Warn) and "no heartbeat" in e.text for e in effects)
    assert sup.tick(6.0) == []  # killed once, not on every tick
    sup.on_reaped(reaped(101, sig=signal.SIGKILL, exit_code=None))
    sup.on_reaped(reaped(102, rank=1, sig=signal.SIGKILL, exit_code=None))
    assert sup.runs == {}  # an ended run goes with its last workload


def test_a_heartbeat_keeps_the_run_alive():
    sup = Supervisor("n1")
    running(sup, [101], timeout_s=5.0)
    for t in range(1, 20):
        sup.heartbeat(CTRL, m.RunHeartbeat(run_id="r1", timeout_s=5.0), float(t))
        assert sup.tick(float(t) + 0.5) == []


def test_a_stopped_attempt_gets_sigterm_then_sigkill_at_its_deadline():
    sup = Supervisor("n1")
    running(sup, [101, 102])
    effects = sup.stop_attempt("r1", 1, grace_s=2.0, now=10.0)
    assert sorted(kills(effects)) == [(101, signal.SIGTERM), (102, signal.SIGTERM)]
    sup.heartbeat(CTRL, m.RunHeartbeat(run_id="r1", timeout_s=5.0), 11.0)
    assert kills(sup.tick(11.9)) == []
    sup.on_reaped(reaped(101))  # one went in its grace
    assert kills(sup.tick(12.0)) == [(102, signal.SIGKILL)]
    sup.heartbeat(CTRL, m.RunHeartbeat(run_id="r1", timeout_s=5.0), 12.5)
    assert kills(sup.tick(13.0)) == []


def test_a_worker_born_after_its_attempt_stopped_is_killed_and_never_announced():
    sup = Supervisor("n1")
    sup.heartbeat(CTRL, m.RunHeartbeat(run_id="r1", timeout_s=5.0), 0.0)
    sup.stop_attempt("r1", 1, 1.0, 0.0)
    effects = sup.on_forked(forked(101), wall=0.0)
    assert kills(effects) == [(101, signal.SIGKILL)] and sent(effects) == []
    assert "stopped before" in effects[0].reason


def test_end_of_run_terminates_its_workers_and_forgets_the_run_once_they_are_gone():
    sup = Supervisor("n1")
    running(sup, [101])
    assert kills(sup.end_run("r1", now=3.0)) == [(101, signal.SIGTERM)]
    assert "r1" in sup.runs
    assert kills(sup.tick(4.0)) == [(101, signal.SIGKILL)]
    (msg,) = sent(sup.on_reaped(reaped(101, sig=signal.SIGKILL, exit_code=None)))
    assert isinstance(msg, m.WorkerExited)
    assert sup.runs == {}
    assert sup.end_run("r1", now=5.0) == []


def test_end_of_a_run_without_workers_forgets_it_at_once():
    sup = Supervisor("n1")
    sup.heartbeat(CTRL, m.RunHeartbeat(run_id="r1", timeout_s=5.0), 0.0)
    assert sup.end_run("r1", 1.0) == [] and sup.runs == {}


def test_a_relaunched_driver_retires_its_predecessor_at_once():
    sup = Supervisor("n1")
    sup.admit(b"old-driver", "run-a", 0.0, run_key="key")
    sup.expect(("run-a", 3, 0, ""), ExpectedWorkload())
    sup.on_forked(forked(101, run_id="run-a", attempt=3), wall=0.0)
    effects = sup.admit(b"new-driver", "run-b", 1.0, run_key="key")
    assert kills(effects) == [(101, signal.SIGKILL)]
    assert sup.runs["run-a"].ended
    assert sup.admit(b"new-driver", "run-b", 1.5, run_key="key") == []  # retired once
    assert sup.tick(100.0) == [Warn("run run-b: no heartbeat from its driver for 98.5 s; killing its workers")]


def test_another_run_key_is_left_alone():
    sup = Supervisor("n1")
    sup.admit(b"a", "run-a", 0.0, run_key="key-a")
    sup.expect(("run-a", 1, 0, ""), ExpectedWorkload())
    sup.on_forked(forked(101, run_id="run-a"), wall=0.0)
    assert sup.admit(b"b", "run-b", 0.0, run_key="key-b") == []


def test_a_dead_fork_server_reports_every_workload_lost_as_a_failure():
    sup = Supervisor("n1")
    running(sup, [101, 102])
    sup.admit(CTRL, "exec", 0.0)
    sup.on_forked(forked(7, run_id="exec", attempt=0, rank=-1, task_id="t1"), wall=0.0)
    sup.expect(("r1", 1, 2, ""), ExpectedWorkload())  # a fork the server never made
    effects = sup.lose_all("the fork server died (exit -9)")
    assert sorted(kills(effects)) == [(7, signal.SIGKILL), (101, signal.SIGKILL), (102, signal.SIGKILL)]
    msgs = sent(effects)
    assert sorted(type(x).__name__ for x in msgs) == ["TaskExited", "WorkerExited", "WorkerExited", "WorkerExited"]
    assert sorted((x.rank, x.pid) for x in msgs if isinstance(x, m.WorkerExited)) == [(0, 101), (1, 102), (2, 0)]
    assert all(x.error is not None and x.error.kind is FailureKind.FORK_SERVER_DIED and "exit -9" in x.error.message
               for x in msgs)
    assert sup.workloads == {} and sup.usage() == {}


def test_the_memory_view_is_a_copy_that_marks_idle_and_killed_workloads():
    sup = Supervisor("n1")
    running(sup, [101, 102])
    sup.stop_attempt("r1", 1, 1.0, 0.0)
    sup.heartbeat(CTRL, m.RunHeartbeat(run_id="r1", timeout_s=5.0, last_commit_at=900.0), 0.5)
    report = m.KillReport(node_id="n1", time=0.0, trigger="test", usage_bytes=2, limit_bytes=1, node_total_bytes=4,
                          target_bytes=1, policy="p", considered=[], selected=["x"], reason="over")
    view = {v.pid: v for v in sup.memory_view()}
    assert view[101].idle and view[101].kind is WorkloadKind.TRAINING and view[101].owner == "r1"
    assert view[101].last_commit_at == 900.0 and view[101].started_at == 1000.0
    assert kills(sup.oom_kill(102, report)) == [(102, signal.SIGKILL)]
    assert {v.pid: v for v in sup.memory_view()}[102].already_killed
    assert not view[102].already_killed  # the earlier snapshot did not change
    (msg,) = sent(sup.on_reaped(reaped(102, rank=1, sig=signal.SIGKILL, exit_code=None)))
    assert msg.kill_report == report and "over" in msg.oom_report


def test_a_worker_that_sigkill_does_not_end_is_reported_by_pid_and_its_node_given_up():
    from outlast.agent.supervisor import GiveUpNode

    sup = Supervisor("n1", unkillable_after_s=30.0)
    running(sup, [101, 102], timeout_s=1000.0)
    assert kills(sup.stop_attempt("r1", 1, grace_s=2.0, now=10.0)) == [(101, signal.SIGTERM), (102, signal.SIGTERM)]
    assert kills(sup.tick(12.0)) == [(101, signal.SIGKILL), (102, signal.SIGKILL)]
    [exited] = sent(sup.on_reaped(reaped(102, rank=1, sig=signal.SIGKILL, exit_code=None)))
    assert exited.rank == 1 and exited.error is None  # one died as it should
    for now in (12.1, 20.0, 41.9):  # the other did not, but not yet for long enough
        assert sup.tick(now) == []
    effects = sup.tick(42.2)
    [exited] = sent(effects)
    assert (exited.pid, exited.rank, exited.signal) == (101, 0, signal.SIGKILL)
    assert exited.error.kind is FailureKind.UNKILLABLE and "pid 101" in exited.error.message
    assert "did not die 30 s after SIGKILL" in exited.error.message
    [give_up] = [e for e in effects if isinstance(e, GiveUpNode)]
    assert "pid 101" in give_up.reason and "node n1" in give_up.reason
    assert sup.tick(100.0) == []  # said once
    assert sup.usage() == {"r1": {"CPU": 1.0}}  # it still holds what it held: the node's capacity is honest
    # It dies at last: nothing is reported again (its exit was told), its leaf is freed.
    effects = sup.on_reaped(reaped(101, sig=signal.SIGKILL, exit_code=None))
    assert sent(effects) == [] and any(isinstance(e, ReleaseLeaf) for e in effects)
    assert any(isinstance(e, Warn) and "died at last" in e.text for e in effects)


def test_killed_ranks_get_sigkill_at_once_and_the_others_run_on():
    sup = Supervisor("n1")
    running(sup, [101, 102, 103])
    effects = sup.kill_ranks("r1", 1, [1], "rank 1 hung")
    assert kills(effects) == [(102, signal.SIGKILL)]
    assert kills(sup.tick(4.0)) == []  # no grace runs out: the others are not stopped
    sup.on_reaped(reaped(102, rank=1, exit_code=None, sig=signal.SIGKILL))
    assert kills(sup.kill_ranks("r1", 1, [1], "again")) == []  # gone
