"""A run that keeps its checkpoints in memory only, on real nodes, loses both holders of one rank's files: the
next attempt restores at once the newest checkpoint that every rank can still get, and the history says which
rank's files went with which nodes and how many steps going back costs."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

from outlast.testing import LocalCluster
from outlast.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.jobs import counting_loop, read_events
from tests.integration.procs import wait_until


def _state(storage_path) -> dict:
    try:
        return json.loads((Path(storage_path) / "run" / "run_state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {"checkpoints": [], "attempts": []}


def _held_in_memory(storage_path, attempt: int, step: int) -> bool:
    return any(r["attempt"] == attempt and r["metrics"].get("step") == step and r["memory_at"]
               for r in _state(storage_path)["checkpoints"])


def _events(events, attempt: int, kind: str) -> list[dict]:
    return [e for e in read_events(events) if e["attempt"] == attempt and e["event"] == kind]


def test_both_holders_of_one_ranks_files_lost_the_next_attempt_restores_the_newest_checkpoint_every_rank_can_get(
        monkeypatch, tmp_path, storage_path):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    seen: dict = {}
    # Four nodes, each a failure domain of its own; one CPU each, so rank 0 runs on node-0 and rank 1 on node-1.
    # Each node's replica goes to the next: rank 0's files are on node-0 and node-1, rank 1's on node-1 and node-2.
    with LocalCluster(num_nodes=4, node_timeout_s=2, cpus_per_node=1, workdir=tmp_path / "cl") as cluster:
        def faults():
            # Attempt 1: rank 1's worker killed. Attempt 2 restores the checkpoint then newest, and node-0 pulls
            # rank 1's files of it from node-1: that copy outlives the nodes killed below.
            wait_until(lambda: _held_in_memory(storage_path, 1, 5), 120, "checkpoint of step 5 held on two nodes")
            wait_until(lambda: any(e["step"] >= 6 for e in _events(events, 1, "step")), 60, "step 6")
            os.kill(next(e["pid"] for e in _events(events, 1, "start") if e["rank"] == 1), signal.SIGKILL)
            wait_until(lambda: len(_events(events, 2, "start")) == 2, 120, "attempt 2 to start")
            seen["restored"] = _events(events, 2, "start")[0]["restored_step"]
            # Rank 1 holds after step 16: the checkpoint of step 14 is the newest committed, and stays so.
            wait_until(lambda: _events(events, 2, "fault"), 120, "rank 1 to hold in attempt 2")
            wait_until(lambda: _held_in_memory(storage_path, 2, 14), 60, "checkpoint of step 14 held on two nodes")
            cluster.kill_node("node-2")  # the replica of rank 1's files
            cluster.kill_node("node-1")  # rank 1's node, with its own copy

        thread = threading.Thread(target=faults, daemon=True)
        thread.start()
        result = Trainer(counting_loop,
                         train_loop_config={"events": str(events), "steps": 24, "every": 3, "sharded": True,
                                            "delete_after_report": True, "step_sleep": 0.2,
                                            "fault": {"rank": 1, "step": 16, "when": "after_report", "kind": "hold",
                                                      "attempts": 2}},
                         scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
                         run_config=RunConfig(name="run", storage_path=storage_path,
                                              failure_config=FailureConfig(max_failures=3),
                                              checkpoint_config=CheckpointConfig(checkpoint_storage="memory"))).fit()
        thread.join()
    assert result.last_metrics == {"step": 23}
    restored = seen["restored"]  # the step of the checkpoint attempt 2 restored (5, or a later one that committed
    assert restored in (5, 8, 11)  # before the kill)
    state = _state(storage_path)
    # The first attempt after the loss restores it: the checkpoints of attempt 2 are gone with rank 1's files.
    assert len(state["attempts"]) == 3
    assert [e["restored_step"] for e in _events(events, 3, "start")] == [restored, restored]
    skipped = [s for s in state["skipped_checkpoints"] if s["checkpoint_dir"].startswith("checkpoint_002_")]
    assert skipped and all("rank 1's files (state_rank1.json) were on node-1, node-2" in s["reason"]
                           and "rank 0" not in s["reason"] for s in skipped), skipped
    # The newest one lost is the checkpoint of step 14: going back to the one restored costs the steps between.
    newest = skipped[0]
    assert newest["steps_lost"] == 14 - restored, newest
    assert f"costs the {14 - restored} reports between them" in newest["reason"]
