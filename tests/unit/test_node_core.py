"""The node's core: a controller's requests, the fork server's reports and drains, as effects."""

from __future__ import annotations

import signal

import msgspec
import pytest

from outlast.agent.node_core import FinishOutput, Fork, NodeCore
from outlast.agent.supervisor import Kill, Send
from outlast.protocol import messages as m
from outlast.protocol.transport import AGENT_REQUESTS, HEADER, BadMessage

C = b"controller"


def spawn(run_id="r", attempt=1, ranks=(0, 1), agent_pid=0, run_key="") -> m.SpawnWorkers:
    return m.SpawnWorkers(run_id=run_id, attempt=attempt, controller_address="tcp://c", payload=b"",
                          workers=[m.WorkerSpec(rank=r, local_rank=r, local_world_size=len(ranks), node_rank=0,
                                                world_size=len(ranks)) for r in ranks],
                          env={}, cwd="/", sys_path=[], run_name="exp", restore_checkpoint=None,
                          resources={"CPU": 1.0}, agent_pid=agent_pid, run_key=run_key)


def draining() -> m.NodeDraining:
    return m.NodeDraining(node_id="n", reason="spot", message="going away", deadline_unix_s=None, node_ids=["n"])


def test_a_heartbeat_and_a_ping_are_answered_with_the_agents_pid():
    core = NodeCore("n", pid=42)
    [pong] = core.on_request(C, m.RunHeartbeat(run_id="r", timeout_s=5.0), now=0.0, head_address="tcp://h")
    assert pong == Send(C, m.Pong(node_id="n", pid=42, head_address="tcp://h"))
    assert core.sup.runs["r"].timeout_s == 5.0
    assert core.on_request(C, m.Ping(), now=0.0) == [Send(C, m.Pong(node_id="n", pid=42))]


def test_a_spawn_asks_for_one_fork_a_rank_each_expected_by_the_supervisor():
    core = NodeCore("n", pid=42)
    forks = core.on_request(C, spawn(), now=0.0)
    assert [(f.key, f.leaf, f.spec.rank) for f in forks] == [(("r", 1, 0, ""), "r-a1-r0", 0),
                                                              (("r", 1, 1, ""), "r-a1-r1", 1)]
    assert all(isinstance(f, Fork) and f.placement.world_size == 2 and f.placement.demand == {"CPU": 1.0}
               for f in forks)
    # The fork server's report finds the placement: the run's controller hears the worker started.
    [started] = core.on_fork_server(m.Forked(run_id="r", attempt=1, rank=0, pid=7), wall=1.0)
    assert isinstance(started.msg, m.WorkerStarted) and core.sup.workloads[7].demand == {"CPU": 1.0}


def test_a_spawn_is_refused_while_draining_and_when_placed_on_an_older_agent():
    core = NodeCore("n", pid=42)
    [refused] = core.on_request(C, spawn(agent_pid=41), now=0.0)
    assert isinstance(refused.msg, m.SpawnRefused) and "started again (pid 41, now 42)" in refused.msg.reason
    assert core.on_request(C, spawn(agent_pid=42), now=0.0)  # the agent it was placed on: taken
    core.drain(draining())
    [refused] = core.on_request(C, spawn(attempt=2), now=0.0)
    assert "draining (spot: going away)" in refused.msg.reason


def test_a_drain_tells_each_run_with_workloads_here_forks_on_their_way_included_once():
    core = NodeCore("n", pid=42)
    core.on_request(C, spawn(run_id="a"), now=0.0)  # forks asked for, none reported yet
    core.on_request(b"other", spawn(run_id="b", ranks=(0,)), now=0.0)
    core.on_fork_server(m.Forked(run_id="b", attempt=1, rank=0, pid=9), wall=0.0)
    core.on_request(b"idle", m.RunHeartbeat(run_id="c", timeout_s=5.0), now=0.0)  # no workload here
    notice = draining()
    assert core.drain(notice) == [Send(C, notice), Send(b"other", notice)]
    assert core.draining == notice


def test_an_end_sends_the_last_output_to_the_run_before_the_supervisor_forgets_it():
    core = NodeCore("n", pid=42)
    core.on_request(C, m.RunHeartbeat(run_id="r", timeout_s=5.0), now=0.0)
    effects = core.on_request(C, m.EndRun(run_id="r"), now=1.0)
    assert effects == [FinishOutput(C, "r", None)] and "r" not in core.sup.runs
    assert core.on_request(C, m.EndRun(run_id="gone"), now=1.0) == [FinishOutput(None, "gone", None)]


def test_a_reaped_worker_sends_its_last_output_then_its_exit():
    core = NodeCore("n", pid=42)
    core.on_request(C, spawn(ranks=(0,)), now=0.0)
    core.on_fork_server(m.Forked(run_id="r", attempt=1, rank=0, pid=7), wall=0.0)
    core.on_request(C, m.StopWorkers(run_id="r", attempt=1, grace_s=1.0), now=0.0)
    effects = core.on_fork_server(m.Reaped(run_id="r", attempt=1, rank=0, pid=7, exit_code=None,
                                           signal=signal.SIGTERM, error=None), wall=0.0)
    assert effects[0] == FinishOutput(C, "r", ("r", 1, 0, ""))
    assert isinstance(effects[-1], Send) and isinstance(effects[-1].msg, m.WorkerExited)


def test_a_stop_terminates_the_attempts_workers_and_other_requests_are_the_agents():
    core = NodeCore("n", pid=42)
    core.on_request(C, spawn(ranks=(0,)), now=0.0)
    core.on_fork_server(m.Forked(run_id="r", attempt=1, rank=0, pid=7), wall=0.0)
    [kill] = core.on_request(C, m.StopWorkers(run_id="r", attempt=1, grace_s=1.0), now=0.0)
    assert kill == Kill(7, signal.SIGTERM, "run r: attempt 1 stopped by its controller")
    assert core.on_request(C, m.StatusRequest(), now=0.0) is None
    assert core.on_request(C, m.ListNodes(), now=0.0) is None


def test_a_task_is_forked_with_its_resources_as_its_demand():
    core = NodeCore("n", pid=42)
    task = m.SpawnTask(run_id="e", task_id="t1", controller_address="tcp://c", payload=b"", env={}, cwd="/",
                       sys_path=[], resources=m.Resources(num_cpus=2.0, memory_bytes=1024), retriable=False)
    [fork] = core.on_request(C, task, now=0.0)
    assert fork.task is task and fork.key == ("e", 0, -1, "t1") and fork.leaf == "task-t1"
    assert fork.placement.demand == {"CPU": 2.0, "memory": 1024.0} and not fork.placement.retriable


def _reaped(run_id, attempt, rank, pid) -> m.Reaped:
    return m.Reaped(run_id=run_id, attempt=attempt, rank=rank, pid=pid, exit_code=None, signal=signal.SIGKILL,
                    error=None)


def _forks(effects):
    return [e for e in effects if isinstance(e, Fork)]


def _stuck_old_driver(core):
    """An older driver's rank 1 of its run, SIGKILLed by the new driver's admission, not yet dead."""
    core.on_request(b"old", spawn(run_id="old", ranks=(0, 1), run_key="s3://b/run"), now=0.0)
    core.on_fork_server(m.Forked(run_id="old", attempt=1, rank=1, pid=11), wall=0.0)
    effects = core.on_request(C, spawn(run_id="new", attempt=2, ranks=(0,), run_key="s3://b/run"), now=20.0)
    assert Kill(11, signal.SIGKILL, "run s3://b/run: a new driver took over from run old") in effects
    return effects


def test_a_new_drivers_spawn_waits_until_the_old_drivers_worker_on_the_node_has_exited():
    core = NodeCore("n", pid=42)
    effects = _stuck_old_driver(core)
    assert _forks(effects) == []  # not beside it: it may be stuck in the kernel
    assert _forks(core.on_request(C, m.RunHeartbeat(run_id="new", timeout_s=5.0), now=21.0)) == []
    forks = _forks(core.on_fork_server(_reaped("old", 1, 1, 11), wall=30.0))
    assert [f.key for f in forks] == [("new", 2, 0, "")]
    assert core.held == {}


def test_a_spawn_held_for_an_earlier_attempt_is_refused_when_stopped_or_when_the_node_drains():
    for ask, said in ((m.StopWorkers(run_id="new", attempt=2, grace_s=1.0), "stopped before its workers started"),
                      (m.EndRun(run_id="new"), "ended before its workers started"),
                      (None, "the node is draining (going away)")):
        core = NodeCore("n", pid=42)
        _stuck_old_driver(core)
        effects = core.drain(draining()) if ask is None else core.on_request(C, ask, now=21.0)
        [refused] = [e.msg for e in effects if isinstance(e, Send) and isinstance(e.msg, m.SpawnRefused)]
        assert refused.attempt == 2 and said in refused.reason
        assert _forks(core.on_fork_server(_reaped("old", 1, 1, 11), wall=30.0)) == [] and core.held == {}


def test_a_spawn_beside_another_run_or_the_same_attempt_is_not_held():
    core = NodeCore("n", pid=42)
    core.on_request(b"other", spawn(run_id="other", ranks=(0,), run_key="s3://b/other"), now=0.0)
    core.on_fork_server(m.Forked(run_id="other", attempt=1, rank=0, pid=11), wall=0.0)
    assert len(_forks(core.on_request(C, spawn(run_id="r", ranks=(0,), run_key="s3://b/run"), now=1.0))) == 1


def test_each_rank_gets_threads_for_its_cpu_request_or_else_its_share_of_the_nodes_cpus():
    asked = NodeCore("n", pid=42, cpus=8.0).on_request(C, spawn(), now=0.0)  # spawn() asks 1 CPU each
    assert [f.threads for f in asked] == [1, 1]
    unasked = msgspec.structs.replace(spawn(ranks=(0, 1, 2)), resources={})
    assert [f.threads for f in NodeCore("n", pid=42, cpus=8.0).on_request(C, unasked, now=0.0)] == [2, 2, 2]
    task = m.SpawnTask(run_id="x", task_id="t", controller_address="tcp://c", payload=b"", env={}, cwd="/",
                       sys_path=[], resources=m.Resources(num_cpus=3.0))
    [*_, fork] = NodeCore("n", pid=42, cpus=8.0).on_request(C, task, now=0.0)
    assert fork.threads == 3


def test_a_spawn_whose_run_id_or_name_cannot_name_a_file_is_refused_when_its_frame_is_decoded():
    # The agent names a rank's output and error files after them: no such spawn reaches the node's core.
    good = msgspec.to_builtins(spawn(), builtin_types=(bytes,))
    assert AGENT_REQUESTS.decode(HEADER + msgspec.msgpack.encode(good)) == spawn()
    for run_id, run_name in (("../../x", "r"), ("r", "a\0b"), ("", "r"), ("r", "..")):
        with pytest.raises(BadMessage, match="run"):
            AGENT_REQUESTS.decode(HEADER + msgspec.msgpack.encode({**good, "run_id": run_id, "run_name": run_name}))
