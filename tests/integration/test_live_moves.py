"""Live recovery's planned changes on a LocalCluster (FailureConfig(live_recovery=True)): real processes, gloo on CPU.

A drain of the node of rank 1 moves that rank to the spare node while the run trains: the controller forks its
replacement there, publishes the planned generation once the replacement waits for it, the ranks form it after the
step in flight, rank 0 sends the state, and the drained process exits. No step is lost, nothing is written to
storage, rank 0 keeps its pid, and the weights are those of a run without the drain. An elastic run (min 2, max 3)
grows when a node joins: the added rank takes the state from rank 0 in a generation of three ranks, in the same
attempt, with no step lost.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig
from tests.integration.jobs import read_events
from tests.integration.live_jobs import live_loop
from tests.integration.procs import wait_until

STEPS = 40


def _fit(storage_path: str, events: Path, name: str, steps: int, **config):
    from outlast.train.torch import TorchTrainer

    return TorchTrainer(
        live_loop, train_loop_config={"events": str(events), "steps": steps, "report": True, **config},
        scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD", resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=0, live_recovery=True)),
    ).fit()


@pytest.mark.torch
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_a_drained_nodes_rank_moves_to_the_spare_node_with_no_step_lost_and_nothing_written(
        storage_path, tmp_path, monkeypatch, fsdp):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    with LocalCluster(num_nodes=3, cpus_per_node=1, node_timeout_s=2, workdir=tmp_path / "cl") as cluster:
        drained: dict[str, str] = {}

        def drain() -> None:
            wait_until(lambda: any(e["event"] == "step" and e["step"] >= 5 for e in read_events(events)), 120,
                       "step 5")
            drained["node"] = next(e["node"] for e in read_events(events) if e["event"] == "start" and e["rank"] == 1)
            cluster.drain_node(drained["node"], deadline_s=60, message="spot reclaimed")

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        result = _fit(storage_path, events, "moved", STEPS, notice=True, until_generation=1, after=10, fsdp=fsdp)
        t.join()
        log = read_events(events)
        trained = max(e["step"] for e in log if e["event"] == "step") + 1
        clean_events = tmp_path / "clean.jsonl"
        _fit(storage_path, clean_events, "clean", trained, fsdp=fsdp)

    assert result.last_metrics == {"step": trained - 1}
    starts = [e for e in log if e["event"] == "start"]
    assert sorted((e["rank"], e["incarnation"]) for e in starts) == [(0, 0), (1, 0), (1, 1)]
    first = {e["rank"]: e for e in starts if e["incarnation"] == 0}
    [moved] = [e for e in starts if e["incarnation"] == 1]
    assert first[1]["node"] == drained["node"] and moved["node"] not in (drained["node"], first[0]["node"])
    assert {e["attempt"] for e in log} == {1}
    # No step lost: none thrown away, and each rank's steps go on one after another across its two processes.
    assert not [e for e in log if e["event"] == "thrown"]
    for rank in (0, 1):
        assert [e["step"] for e in log if e["event"] == "step" and e["rank"] == rank] == list(range(trained))
    assert moved["step"] == 1 + max(e["step"] for e in log if e["event"] == "step" and e["pid"] == first[1]["pid"])
    assert trained - moved["step"] == 10  # the replacement trained in the group
    # Rank 0 never stopped; the drained process exited without ending the run; both were told of the drain.
    assert {e["pid"] for e in log if e["rank"] == 0} == {first[0]["pid"]}
    assert [e["event"] for e in log if e["pid"] == first[1]["pid"]][-1] != "end"
    for pid in (first[0]["pid"], first[1]["pid"]):
        [notice] = [e for e in log if e["event"] == "notice" and e["pid"] == pid]
        assert notice["ranks"] == [1] and notice["node_ids"] == [drained["node"]]
    # The weights of a run without the drain, on both ranks.
    final = {e["rank"]: e["exact"] for e in log if e["event"] == "end"}
    clean = {e["rank"]: e["exact"] for e in read_events(clean_events) if e["event"] == "end"}
    assert set(final) == {0, 1} and final == clean
    # Nothing written to storage; the history has the drain, moved live, charged as a preemption.
    state = json.loads((Path(storage_path) / "moved" / "run_state.json").read_text())
    assert state["checkpoints"] == [] and state["latest_checkpoint"] is None
    assert not [p for p in (Path(storage_path) / "moved").iterdir() if p.name.startswith("checkpoint")]
    assert len(state["attempts"]) == 1 and state["status"] == "finished"
    assert state["failure_counts"] == {"preemption": 1}
    [recovery] = state["live_recoveries"]
    assert recovery["path"] == "live" and recovery["cause"].startswith("drain") and recovery["ranks"] == [1]
    assert recovery["steps_lost"] == 0
    assert [d["ranks"] for d in state["drains"]] == [[1]]


def _grow(storage_path: str, tmp_path: Path, name: str, added: tuple[str, ...] = ("node-2",),
          **config) -> tuple[list[dict], dict, int]:
    """An elastic run of 2 one-CPU ranks on 2 nodes, up to one rank a node `added` after step 5, that trains 10
    steps past the generation the grow forms: (its events, its run state, the steps trained)."""
    from outlast.train.torch import TorchTrainer

    events = tmp_path / "events.jsonl"
    with LocalCluster(num_nodes=2, cpus_per_node=1, node_timeout_s=2, workdir=tmp_path / "cl") as cluster:
        def join() -> None:
            wait_until(lambda: any(e["event"] == "step" and e["step"] >= 5 for e in read_events(events)), 120,
                       "step 5")
            for node in added:
                cluster.add_node(node)

        t = threading.Thread(target=join, daemon=True)
        t.start()
        result = TorchTrainer(
            live_loop, train_loop_config={"events": str(events), "steps": STEPS, "report": True,
                                          "until_generation": 1, "after": 10, **config},
            scaling_config=ScalingConfig(num_workers=(2, 2 + len(added)), resources_per_worker={"CPU": 1},
                                         elastic_resize_monitor_interval_s=0),
            run_config=RunConfig(name=name, storage_path=storage_path,
                                 failure_config=FailureConfig(max_failures=0, live_recovery=True)),
        ).fit()
        t.join()
    log = read_events(events)
    trained = max(e["step"] for e in log if e["event"] == "step") + 1
    assert result.last_metrics == {"step": trained - 1}
    state = json.loads((Path(storage_path) / name / "run_state.json").read_text())
    assert len(state["attempts"]) == 1 and state["status"] == "finished" and state["failure_counts"] == {}
    [recovery] = state["live_recoveries"]
    assert recovery["path"] == "live" and recovery["cause"].startswith("grow")
    assert recovery["ranks"] == list(range(2, 2 + len(added)))
    assert recovery["steps_lost"] == 0
    return log, state, trained


@pytest.mark.torch
def test_an_elastic_run_grows_live_when_a_node_joins_with_no_step_lost_and_no_restart(
        storage_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    log, state, trained = _grow(storage_path, tmp_path, "grown")
    starts = {e["rank"]: e for e in log if e["event"] == "start"}
    assert sorted(starts) == [0, 1, 2] and len([e for e in log if e["event"] == "start"]) == 3
    assert starts[2]["node"] == "node-2" and starts[2]["step"] == trained - 10
    assert {e["attempt"] for e in log} == {1}
    # No step lost: none thrown away; the first ranks trained every step, the added one every step since it joined.
    assert not [e for e in log if e["event"] == "thrown"]
    for rank in (0, 1):
        assert [e["step"] for e in log if e["event"] == "step" and e["rank"] == rank] == list(range(trained))
        assert {e["pid"] for e in log if e["rank"] == rank} == {starts[rank]["pid"]}
    assert [e["step"] for e in log if e["event"] == "step" and e["rank"] == 2] == list(range(trained - 10, trained))
    ends = {e["rank"]: e for e in log if e["event"] == "end"}
    assert {e["world"] for e in ends.values()} == {3} and ends[0]["exact"] == ends[1]["exact"] == ends[2]["exact"]
    assert state["attempts"][0]["workers"] == 3
    assert state["checkpoints"] == []  # no budget drawn, nothing to restore
    [resize] = state["resizes"]
    assert (resize["from_workers"], resize["to_workers"], resize["steps_lost"]) == (2, 3, 0)


@pytest.mark.torch
def test_an_elastic_run_that_commits_a_checkpoint_each_step_grows_live_without_waiting_on_the_added_rank(
        storage_path, tmp_path, monkeypatch):
    # Rank 0's report() of each step's checkpoint returns once the checkpoint is committed. One reported between the
    # grow and the join waited for the added rank's report of it, which never comes (it takes up rank 0's count),
    # and rank 0 never sent it the state: the added rank's wait timed out, a failure past max_failures=0.
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    log, state, _ = _grow(storage_path, tmp_path, "grown_checkpoints", checkpoint=True)
    assert sorted(e["rank"] for e in log if e["event"] == "start") == [0, 1, 2]
    assert state["latest_checkpoint"] is not None


@pytest.mark.torch
def test_a_drained_rank_0_in_a_checkpoint_s_report_moves_live_once_its_commit_is_answered_to_it(
        storage_path, tmp_path, monkeypatch):
    # Rank 0 reports a checkpoint each step, its report() returning once it is committed. Answered to the process
    # of rank 0 that spoke last, the commit went to its replacement, which said hello meanwhile: the drained process
    # waited for ever, and rank 1 in the next step's allreduce with it.
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    with LocalCluster(num_nodes=3, cpus_per_node=1, node_timeout_s=2, workdir=tmp_path / "cl") as cluster:
        def drain() -> None:
            wait_until(lambda: any(e["event"] == "step" and e["step"] >= 5 for e in read_events(events)), 120,
                       "step 5")
            node = next(e["node"] for e in read_events(events) if e["event"] == "start" and e["rank"] == 0)
            cluster.drain_node(node, deadline_s=60, message="spot reclaimed")

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        result = _fit(storage_path, events, "moved_checkpoints", STEPS, checkpoint=True, until_generation=1,
                      after=10)
        t.join()
    log = read_events(events)
    trained = max(e["step"] for e in log if e["event"] == "step") + 1
    assert result.last_metrics == {"step": trained - 1}
    starts = [e for e in log if e["event"] == "start"]
    assert sorted((e["rank"], e["incarnation"]) for e in starts) == [(0, 0), (0, 1), (1, 0)]
    assert not [e for e in log if e["event"] == "thrown"]
    # The drained process's report() of the last step it committed returned: its commit was answered to it.
    [drained] = [e["pid"] for e in starts if (e["rank"], e["incarnation"]) == (0, 0)]
    last = max(e["step"] for e in log if e["event"] == "step" and e["pid"] == drained)
    assert [e for e in log if e["event"] == "reported" and e["pid"] == drained and e["step"] == last]
    state = json.loads((Path(storage_path) / "moved_checkpoints" / "run_state.json").read_text())
    assert len(state["attempts"]) == 1 and state["status"] == "finished"
    assert state["failure_counts"] == {"preemption": 1}
    [recovery] = state["live_recoveries"]
    assert recovery["path"] == "live" and recovery["cause"].startswith("drain") and recovery["steps_lost"] == 0


@pytest.mark.torch
def test_a_run_that_splits_its_optimizer_grows_live_by_a_whole_replica(storage_path, tmp_path, monkeypatch):
    # Two ranks, one replica of two shards (Adam's moments split); two nodes join after step 5. The run grows by a
    # whole replica, to four ranks: each added rank takes the state from the holder of its shard, the replicas'
    # and the shards' groups form again at the new size, and no step is lost.
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    log, _, trained = _grow(storage_path, tmp_path, "grown_shards", added=("node-2", "node-3"), shards=2)
    assert not [e for e in log if e["event"] == "thrown"]
    for rank in (0, 1):
        assert [e["step"] for e in log if e["event"] == "step" and e["rank"] == rank] == list(range(trained))
    for rank in (2, 3):
        assert [e["step"] for e in log if e["event"] == "step" and e["rank"] == rank] == list(range(trained - 10,
                                                                                                  trained))
    ends = {e["rank"]: e for e in log if e["event"] == "end"}
    assert {e["world"] for e in ends.values()} == {4}
    assert ends[0]["exact"] == ends[1]["exact"] == ends[2]["exact"] == ends[3]["exact"]
