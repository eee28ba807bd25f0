"""An elastic run on a LocalCluster: (min 2, max 4) over three one-CPU nodes starts at 3, shrinks to 2 at once
when a node is killed, and grows back to 3 without losing a step when a node joins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig
from tests.integration.elastic_jobs import elastic_torch_loop
from tests.integration.jobs import read_events
from tests.integration.procs import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _starts(events) -> list[dict]:
    return [e for e in read_events(events) if e["event"] == "start"]


@pytest.mark.torch
def test_min_2_max_4_shrinks_on_a_killed_node_and_grows_on_a_joined_one_charging_no_failure(
        storage_path, tmp_path, monkeypatch):
    from outlast.train.torch import TorchTrainer

    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    steps = 400
    with LocalCluster(num_nodes=3, cpus_per_node=1, node_timeout_s=2) as cluster:
        def faults():
            wait_until(lambda: any(e["event"] == "step" and e["attempt"] == 1 and e["step"] >= 15
                                   for e in read_events(events)), 120, "attempt 1 at step 15")
            cluster.kill_node("node-2")
            wait_until(lambda: any(e["event"] == "step" and e["attempt"] == 2 and e["step"] >= 40
                                   for e in read_events(events)), 120, "attempt 2 training")
            cluster.add_node("node-3")

        t = threading.Thread(target=faults, daemon=True)
        t.start()
        TorchTrainer(elastic_torch_loop, train_loop_config={"events": str(events), "steps": steps, "every": 10,
                                                            "step_sleep": 0.03},
                     scaling_config=ScalingConfig(num_workers=(2, 4), resources_per_worker={"CPU": 1},
                                                  elastic_resize_monitor_interval_s=0),
                     run_config=RunConfig(name="run", storage_path=storage_path,
                                          failure_config=FailureConfig(max_failures=0))).fit()
        t.join()
    state = json.loads((Path(storage_path) / "run" / "run_state.json").read_text())
    assert state["status"] == "finished"
    assert [a["workers"] for a in state["attempts"]] == [3, 2, 3]
    assert "worker" not in state["failure_counts"]  # max_failures=0: a charged failure would have ended the run
    shrink, grow = state["resizes"]
    assert (shrink["from_workers"], shrink["to_workers"]) == (3, 2) and "node-2 lost" in shrink["reason"]
    assert (grow["from_workers"], grow["to_workers"]) == (2, 3) and grow["steps_lost"] == 0
    assert shrink["steps_lost"] < 10  # at most the checkpoint interval
    starts = _starts(events)
    for attempt, world in ((1, 3), (2, 2), (3, 3)):
        mine = [e for e in starts if e["attempt"] == attempt]
        assert len(mine) == world and {(e["world"], e["dist_world"]) for e in mine} == {(world, world)}
        assert sum(e["shard"] for e in mine) == 120  # prepare_data_loader shards for this attempt's world
    notices = [e for e in read_events(events) if e["event"] == "notice" and e["attempt"] == 2]
    assert {n["reason"] for n in notices} == {"resize"} and len({n["step"] for n in notices}) == 1
    restored = {e["restored_step"] for e in starts if e["attempt"] == 3}
    assert restored == {notices[0]["step"]}  # the grow lost no step
    steps_seen = {e["world"] for e in read_events(events) if e["event"] == "step" and e["attempt"] == 3}
    assert steps_seen == {3}  # every all_reduce of attempt 3 summed three ranks
    shown = subprocess.run([sys.executable, "-m", "outlast.cli.main", "runs", storage_path, "run"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert "3 -> 2 workers" in shown.stdout and "2 -> 3 workers, 0 steps lost: grow" in shown.stdout


@pytest.mark.torch
def test_the_dcp_example_restores_a_checkpoint_sharded_over_2_ranks_on_3_after_the_run_grows(tmp_path):
    storage = tmp_path / "storage"
    state_file = storage / "dcp" / "run_state.json"
    with LocalCluster(num_nodes=2, cpus_per_node=1) as cluster:
        env = {**os.environ, "OUTLAST_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1",
               "OUTLAST_ADDRESS": cluster.head_address, "OUTLAST_CLUSTER_KEY": str(cluster.key_file)}
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "elastic_dcp_checkpoint.py"), "--storage_path", str(storage),
             "--run_name", "dcp", "--steps", "150", "--step_s", "0.03", "--checkpoint_every", "10"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_until(lambda: proc.poll() is not None or (
                state_file.exists() and json.loads(state_file.read_text())["latest_checkpoint"]), 180,
                "the first checkpoint")
            assert proc.poll() is None, proc.stdout.read()
            cluster.add_node("node-2")
            out, _ = proc.communicate(timeout=300)
        finally:
            proc.kill()
        assert proc.returncode == 0, out
    state = json.loads(state_file.read_text())
    assert [a["workers"] for a in state["attempts"]] == [2, 3]
    (grow,) = state["resizes"]
    assert grow["steps_lost"] == 0
    # What the ranks print reaches the driver's stdout, one line per rank of the grown attempt.
    restored = [line for line in out.splitlines() if "restored step" in line]
    assert len(restored) == 3, out[-3000:]
    assert all("at world size 3 from a checkpoint written at world size 2: every value as saved" in line
               for line in restored)
