"""Runs on real nodes that keep their checkpoints in memory: the controller has each rank's node copy its
files and replicate them to the other node; a killed rank restores from its node's memory, a lost node's
ranks from the replica on the node that is left, a memory-only run commits without uploading a file, and
one moved to a third node restores from copies its nodes pull from the others."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from outlast.storage.records import MANIFEST_NAME
from outlast.testing import LocalCluster
from tests.integration.jobs import fit_counting, read_events
from tests.integration.procs import wait_until


@pytest.fixture
def cluster(monkeypatch, tmp_path):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    with LocalCluster(num_nodes=2, node_timeout_s=2, cpus_per_node=2, workdir=tmp_path / "cl") as c:
        yield c


def _state(storage_path) -> dict:
    return json.loads((Path(storage_path) / "run" / "run_state.json").read_text())




def _restored(events) -> list:
    return [e["restored_step"] for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2]


def test_a_killed_rank_restores_from_the_copy_in_its_nodes_memory(cluster, storage_path, tmp_path, capfd):
    events = tmp_path / "events.jsonl"
    result = fit_counting(storage_path, events, steps=10, fault={"rank": 1, "step": 6, "when": "after_report", "kind": "kill"})
    assert result.last_metrics == {"step": 9}
    assert _restored(events) == [5, 5]
    out = capfd.readouterr()
    said = out.out + out.err
    assert "restored checkpoint_001_000005 from local_memory" in said, said[-3000:]
    assert "from storage" not in said
    record = _state(storage_path)["checkpoints"][-1]
    # Every rank's files on its node and on the other: committed in memory as well as durable.
    assert record["memory"] == ["node-0", "node-1"] and record["memory_at"] and record["durable"] is True


def test_a_lost_nodes_ranks_restore_from_the_replica_on_the_node_left(cluster, storage_path, tmp_path, capfd):
    events = tmp_path / "events.jsonl"

    def kill_once_replicated():
        def replicated():
            try:
                state = _state(storage_path)
            except (FileNotFoundError, json.JSONDecodeError):
                return False
            return any(r["report_index"] == 5 and r["memory_at"] for r in state["checkpoints"])

        wait_until(replicated, 60, "checkpoint 5 held on both nodes")
        # Rank 1 holds after step 7, so no later checkpoint commits (and needs its own replica) however slow this is.
        wait_until(lambda: any(e["event"] == "fault" for e in read_events(events)), 60, "rank 1 to hold at step 7")
        cluster.kill_node("node-1")

    killer = threading.Thread(target=kill_once_replicated, daemon=True)
    killer.start()
    result = fit_counting(storage_path, events, steps=40, every=6,
                  fault={"rank": 1, "step": 7, "when": "after_report", "kind": "hold"})
    killer.join()
    assert result.last_metrics == {"step": 39}
    assert _restored(events) == [5, 5]  # nothing after checkpoint 5 committed while rank 1 held
    said = "".join(capfd.readouterr())
    # Both ranks on node-0 now: rank 1's files are the replica node-1 pushed there before it died.
    assert "from local_memory (the files of ranks [1] from the replicas kept here)" in said, said[-3000:]
    assert "from storage" not in said


def test_a_memory_only_run_commits_without_storage_and_restores_from_memory(cluster, storage_path, tmp_path, capfd):
    events = tmp_path / "events.jsonl"
    result = fit_counting(storage_path, events, steps=10, storage="memory",
                  fault={"rank": 0, "step": 6, "when": "after_report", "kind": "kill"})
    assert result.last_metrics == {"step": 9}
    assert _restored(events) == [5, 5]
    said = "".join(capfd.readouterr())
    assert "restored checkpoint_001_000005 from local_memory" in said, said[-3000:]
    state = _state(storage_path)
    assert [r["metrics"]["step"] for r in state["checkpoints"]] == [2, 5, 8]
    for r in state["checkpoints"]:
        assert r["durable"] is False and r["memory"] == ["node-0", "node-1"] and r["memory_at"]
        stored = sorted(p.name for p in (Path(storage_path) / "run" / r["checkpoint_dir"]).iterdir())
        assert stored == [MANIFEST_NAME]  # no file of the checkpoint went to storage
        manifest = json.loads((Path(storage_path) / "run" / r["checkpoint_dir"] / MANIFEST_NAME).read_text())
        assert manifest["durable"] is False and manifest["memory"] == ["node-0", "node-1"]
        assert {f["path"] for f in manifest["files"]} == {"state.json", "state_rank0.json", "state_rank1.json"}


def test_a_memory_only_run_moved_to_a_third_node_restores_from_copies_pulled_from_the_peers(monkeypatch, tmp_path,
                                                                                            storage_path, capfd):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    with LocalCluster(num_nodes=3, node_timeout_s=2, cpus_per_node=1, workdir=tmp_path / "cl") as cluster:
        def kill_once_replicated():
            def replicated():
                try:
                    return any(r["report_index"] == 5 and r["memory_at"] for r in _state(storage_path)["checkpoints"])
                except (FileNotFoundError, json.JSONDecodeError):
                    return False

            wait_until(replicated, 60, "checkpoint 5 held on two nodes")
            wait_until(lambda: any(e["event"] == "step" and e["step"] >= 7 for e in read_events(events)), 60,
                       "step 7")
            cluster.kill_node("node-1")

        killer = threading.Thread(target=kill_once_replicated, daemon=True)
        killer.start()
        result = fit_counting(storage_path, events, steps=40, every=6, storage="memory")
        killer.join()
    assert result.last_metrics == {"step": 39}
    starts = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2]
    assert len(starts) == 2 and min(e["restored_step"] for e in starts) >= 5
    said = "".join(capfd.readouterr())
    # node-2 held only rank 1's replica, node-0 only rank 0's own copy: each pulled the other's.
    restored = re.findall(r"\[rank (\d) (node-\d) a2\] outlast INFO rank \d restored checkpoint_001_\d+ from (\w+)", said)
    assert sorted(restored) == [("0", "node-0", "local_memory"), ("1", "node-2", "local_memory")], said[-3000:]
