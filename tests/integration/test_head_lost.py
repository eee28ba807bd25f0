"""A cluster without etcd whose head agent dies for good: a run that needs a node it cannot get ends at once,
saying that the head is gone and what to run, instead of failing every new attempt's commits for want of a node
in another failure domain that no node can bring."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from outlast.testing import LocalCluster
from outlast.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, Trainer, TrainingFailedError
from tests.integration.jobs import counting_loop, read_events
from tests.integration.procs import wait_until


def test_a_memory_run_whose_head_is_killed_ends_at_once_saying_the_head_is_gone_and_to_use_etcd(
        monkeypatch, tmp_path, storage_path):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    # The head (node-0) runs rank 0; once it is gone, node-1 takes both ranks, and has no peer to commit to.
    with LocalCluster(num_nodes=2, node_timeout_s=2, workdir=tmp_path / "cl") as cluster:
        def kill_the_head():
            wait_until(lambda: any(e["event"] == "step" and e["step"] >= 4 for e in read_events(events)), 120,
                       "step 4")
            cluster.kill_node("node-0")

        killer = threading.Thread(target=kill_the_head, daemon=True)
        killer.start()
        with pytest.raises(TrainingFailedError) as info:
            Trainer(counting_loop,
                    train_loop_config={"events": str(events), "steps": 1000, "every": 3, "sharded": True,
                                       "delete_after_report": True, "step_sleep": 0.1},
                    scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
                    run_config=RunConfig(name="run", storage_path=storage_path,
                                         failure_config=FailureConfig(max_failures=3),
                                         checkpoint_config=CheckpointConfig(checkpoint_storage="memory"))).fit()
        killer.join()
        head = cluster.nodes["node-0"].address
    said = str(info.value)
    assert f"the head node node-0 ({head})" in said and "it is gone" in said, said
    assert "outlast start --etcd" in said and "docs/operations/etcd.md" in said, said
    assert "run fit() again with the same RunConfig(name, storage_path)" in said, said
    state = json.loads((Path(storage_path) / "run" / "run_state.json").read_text())
    assert state["status"] == "errored" and "the head node node-0" in state["error"]
