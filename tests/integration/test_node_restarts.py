"""outlast outlasts its own crashes: a killed fork server, a killed embedded node agent, and a
persistent node whose agent dies and is started again. Each run ends bit for bit where a run
without faults ends."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from outlast.client.discovery import start_agent_process
from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.jobs import deterministic_ddp_loop, node_logging_loop, read_events
from tests.integration.procs import wait_until


def _train(storage_path, tmp_path, name, faults, max_failures=3):
    from outlast.train.torch import TorchTrainer

    events = tmp_path / f"{name}.jsonl"
    result = TorchTrainer(
        deterministic_ddp_loop,
        train_loop_config={"events": str(events), "steps": 30, "every": 4, "faults": faults},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures)),
    ).fit()
    digests = [e["digest"] for e in read_events(events) if e["event"] == "weights"]
    return result, digests


def _state(storage_path, name) -> dict:
    return json.loads((Path(storage_path) / name / "run_state.json").read_text())


def _placed(events, attempt: int) -> dict[int, str]:
    return {e["rank"]: e["node_id"] for e in read_events(events) if e["event"] == "placed" and e["attempt"] == attempt}


def _failures(state: dict) -> list[dict]:
    return [f for a in state["attempts"] for f in a["failures"]]


@pytest.fixture(scope="module")
def clean_digest(tmp_path_factory):
    path = tmp_path_factory.mktemp("clean")
    (path / "storage").mkdir()
    # Module-scoped, so before the per-test OUTLAST_HOME: a home of its own, never the user's.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OUTLAST_HOME", str(tmp_path_factory.mktemp("clean_home")))
        mp.delenv("OUTLAST_ADDRESS", raising=False)
        _, digests = _train(str(path / "storage"), path, "clean", [])
    assert len(digests) == 1
    return digests[0]


@pytest.mark.torch
def test_a_killed_fork_server_costs_one_restart_and_the_weights_are_the_same(storage_path, tmp_path, clean_digest):
    result, digests = _train(storage_path, tmp_path, "forkserver", [[1, 1, 6, "forkserver"]], max_failures=1)
    assert digests == [clean_digest] and result.last_metrics == {"step": 29}
    state = _state(storage_path, "forkserver")
    assert state["failure_counts"]["worker"] == 1 and len(state["attempts"]) == 2
    assert {f["kind"] for f in _failures(state)} == {"ForkServerDied"}
    assert all("fork server" in f["message"] and "SIGKILL" in f["message"] for f in _failures(state))


@pytest.mark.torch
def test_a_killed_embedded_node_agent_is_restarted_by_its_driver(storage_path, tmp_path, clean_digest):
    result, digests = _train(storage_path, tmp_path, "agent", [[1, 0, 6, "agent"]], max_failures=1)
    assert digests == [clean_digest] and result.last_metrics == {"step": 29}
    state = _state(storage_path, "agent")
    assert state["failure_counts"]["worker"] == 1 and len(state["attempts"]) == 2
    messages = [f["message"] for f in _failures(state)]
    assert messages and all("embedded node agent died (killed by SIGKILL); the driver restarts it" in msg
                            for msg in messages)


@pytest.mark.parametrize("victim_rank", [1, 0], ids=["member", "head"])
def test_a_persistent_node_whose_agent_dies_is_lost_at_once_and_used_again_once_restarted(
        storage_path, tmp_path, monkeypatch, victim_rank):
    # Heartbeat timeouts far beyond what the test waits: the loss is seen from the process table.
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "300")
    monkeypatch.setenv("OUTLAST_CAPACITY_TIMEOUT_S", "300")
    events = tmp_path / "events.jsonl"
    seen: dict = {}
    with LocalCluster(num_nodes=2, node_timeout_s=300) as cluster:
        def kill_then_restart():
            wait_until(lambda: any(e["event"] == "step" and e["step"] >= 6 for e in read_events(events)), 120,
                       "step 6")
            victim = seen["victim"] = _placed(events, 1)[victim_rank]
            cluster.kill_node(victim)
            state_file = Path(storage_path) / "run" / "run_state.json"
            wait_until(lambda: json.loads(state_file.read_text())["status"] == "waiting_for_capacity", 60,
                       "the run to wait for the lost node (long before any heartbeat timeout)")
            seen["waiting_for"] = json.loads(state_file.read_text())["waiting_for"]
            if victim_rank == 1:  # a dead head has no table to show
                seen["table"] = {n.node_id: n.state for n in cluster.node_table()}
            cluster.restart_node(victim)
            seen["log"] = cluster.nodes[victim].log_path.read_text()

        helper = threading.Thread(target=kill_then_restart, daemon=True)
        helper.start()
        result = Trainer(node_logging_loop, train_loop_config={"events": str(events), "steps": 20, "step_sleep": 0.05},
                         scaling_config=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD"),
                         run_config=RunConfig(name="run", storage_path=storage_path,
                                              failure_config=FailureConfig(max_failures=1))).fit()
        helper.join()
    victim = seen["victim"]
    assert result.last_metrics == {"step": 19}
    if victim_rank == 1:
        assert seen["table"][victim] == "dead"  # the head's table: never "alive" once its agent is gone
    assert f"agents/{victim}: left by an agent that is gone (pid " in seen["log"]  # the restarted agent cleaned up
    assert "on the 1 usable node(s)" in seen["waiting_for"]
    assert set(_placed(events, 2).values()) == set(_placed(events, 1).values())  # the restarted node is used
    state = _state(storage_path, "run")
    (lost,) = [f for f in _failures(state) if f["kind"] == "NodeLost"]
    # Seen from the process table, by this driver or first by the head (its table then says dead): both at once,
    # with the heartbeat timeout at 300 s.
    assert lost["node_id"] == victim and (f"node agent of node {victim}" in lost["message"] and "is gone" in lost["message"]
                                          or f"the head declared node {victim} " in lost["message"]), lost["message"]
    assert state["failure_counts"]["worker"] == 1


def test_a_restarted_head_takes_its_members_back(monkeypatch):
    with LocalCluster(num_nodes=2, node_timeout_s=300) as cluster:
        cluster.kill_node("node-0")
        cluster.restart_node("node-0")  # a new head: its table starts empty
        wait_until(lambda: {n.node_id: n.state for n in cluster.node_table()} == {"node-0": "alive",
                                                                                   "node-1": "alive"},
                   60, "the member to register with the restarted head")


def test_a_fork_server_that_keeps_dying_is_backed_off_then_given_up_with_the_reason(tmp_path):
    log_path = tmp_path / "agent.log"
    proc, _ = start_agent_process(["tests.integration.dies_on_import"], embedded=False, log_path=log_path,
                                  extra_args=["--die-with-parent"])
    try:
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text()
    assert code == 0  # it stopped itself, saying why
    assert log.count("started the fork server again") == 4
    assert "restarting it in 1 s" in log and "restarting it in 2 s" in log and "restarting it in 4 s" in log
    assert "died 4 times in a row" in log and "exit code 7" in log and "stopping the node" in log
