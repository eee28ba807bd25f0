"""Exact resume with real processes: a run's data goes on at the next batch of its epoch after a worker is killed,
after its driver is killed and relaunched, after a drain, and across a resize, so that every row is used exactly
once in each epoch, through get_dataset_shard's iterators (of rows in memory, and of an outlast.data Dataset read a
block at a time) and prepare_data_loader's loaders alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from outlast.testing import LocalCluster
from outlast.train import ScalingConfig
from tests.integration import data_jobs
from tests.integration.jobs import read_events
from tests.integration.procs import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _state(storage_path, name="run") -> dict:
    return json.loads((Path(storage_path) / name / "run_state.json").read_text())


def assert_each_row_used_once_per_epoch(events, epochs, rows=data_jobs.ROWS):
    uses = data_jobs.uses_per_epoch(events)
    for kind in data_jobs.KINDS:
        assert sorted(uses[kind]) == list(range(epochs)), kind
        for epoch, counts in uses[kind].items():
            assert set(counts) == set(range(rows)), (kind, epoch, sorted(set(range(rows)) - set(counts)))
            assert set(counts.values()) == {1}, (kind, epoch, {r: n for r, n in counts.items() if n != 1})


def _restored_mid_epoch(events) -> list[int]:
    return [e["restored_step"] for e in read_events(events) if e["event"] == "start" and e["attempt"] > 1]


@pytest.mark.torch
def test_a_killed_worker_resumes_at_the_next_batch_every_row_used_once_per_epoch(storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    fault = {"when": "step", "step": 5, "rank": 1, "kind": "kill"}  # mid-epoch 0 (8 steps an epoch at 3 ranks)
    data_jobs.fit(storage_path, str(events), workers=3, epochs=2, fault=fault)
    state = _state(storage_path)
    assert [a["outcome"] for a in state["attempts"]] == ["failed", "finished"]
    assert set(_restored_mid_epoch(events)) == {4}
    assert_each_row_used_once_per_epoch(events, 2)


@pytest.mark.torch
def test_a_relaunched_driver_goes_on_at_the_next_batch_every_row_used_once_per_epoch(storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    args = [sys.executable, "-m", "tests.integration.data_jobs", storage_path, str(events), "--workers", "2",
            "--epochs", "2"]
    first = subprocess.Popen([*args, "--step-sleep", "0.1"], cwd=ROOT, env=dict(os.environ),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: any(e["event"] == "used" and e["step"] >= 5 for e in read_events(events)), 120, "step 5")
    finally:
        first.kill()
        first.wait()
    second = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert second.returncode == 0, second.stderr[-3000:]
    assert [a["outcome"] for a in _state(storage_path)["attempts"]] == ["driver_lost", "finished"]
    assert all(0 < s < 23 for s in _restored_mid_epoch(events))  # 12 steps an epoch at 2 ranks
    assert_each_row_used_once_per_epoch(events, 2)


def _when(events, predicate, action, what: str) -> threading.Thread:
    def run():
        wait_until(lambda: predicate(read_events(events)), 120, what)
        action()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _at(attempt: int, step: int):
    return lambda evs: any(e["event"] == "used" and e["attempt"] == attempt and e["step"] >= step for e in evs)


@pytest.mark.torch
def test_a_drained_run_goes_on_at_the_next_batch_on_another_node(storage_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    with LocalCluster(num_nodes=2, node_timeout_s=2, workdir=tmp_path / "cl") as cluster:
        drainer = _when(events, _at(1, 5), lambda: cluster.drain_node("node-0", deadline_s=20), "step 5")
        data_jobs.fit(storage_path, str(events), workers=2, epochs=2, step_sleep=0.05)
        drainer.join()
    state = _state(storage_path)
    assert [a["outcome"] for a in state["attempts"]][-1] == "finished" and len(state["attempts"]) == 2
    assert state["failure_counts"] == {"preemption": 1}
    assert all(0 < s < 23 for s in _restored_mid_epoch(events))
    assert_each_row_used_once_per_epoch(events, 2)


@pytest.mark.torch
def test_a_resize_three_two_three_splits_the_rest_of_the_epoch_every_row_used_once(storage_path, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    with LocalCluster(num_nodes=3, cpus_per_node=1, node_timeout_s=2, workdir=tmp_path / "cl") as cluster:
        def faults():
            wait_until(lambda: _at(1, 3)(read_events(events)), 120, "attempt 1 at step 3")
            cluster.kill_node("node-2")
            wait_until(lambda: _at(2, 1)(read_events(events)), 120, "attempt 2 training")
            cluster.add_node("node-3")

        t = threading.Thread(target=faults, daemon=True)
        t.start()
        data_jobs.fit(storage_path, str(events), epochs=3, step_sleep=0.1, max_failures=0,
                      scaling=ScalingConfig(num_workers=(2, 4), resources_per_worker={"CPU": 1},
                                            elastic_resize_monitor_interval_s=0))
        t.join()
    state = _state(storage_path)
    assert state["status"] == "finished" and [a["workers"] for a in state["attempts"]] == [3, 2, 3]
    assert_each_row_used_once_per_epoch(events, 3)


@pytest.mark.torch
def test_with_virtual_ranks_a_run_resized_three_two_three_ends_with_the_weights_of_one_rank_alone(
        storage_path, tmp_path, monkeypatch):
    """Bit for bit: the steps at 3, 2 and 3 ranks read the same rows and sum the same gradients in the same order
    as a run of one rank that never failed (data_jobs.virtual_loop, 12 virtual ranks)."""
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    alone_events = tmp_path / "alone.jsonl"
    data_jobs.fit_virtual(storage_path, str(alone_events), ScalingConfig(num_workers=1), name="alone")
    events = tmp_path / "events.jsonl"
    with LocalCluster(num_nodes=3, cpus_per_node=1, node_timeout_s=2, workdir=tmp_path / "cl") as cluster:
        def faults():
            wait_until(lambda: _at(1, 2)(read_events(events)), 120, "attempt 1 at step 2")
            cluster.kill_node("node-2")
            wait_until(lambda: _at(2, 1)(read_events(events)), 120, "attempt 2 training")
            cluster.add_node("node-3")

        t = threading.Thread(target=faults, daemon=True)
        t.start()
        data_jobs.fit_virtual(storage_path, str(events), ScalingConfig(
            num_workers=(2, 3), resources_per_worker={"CPU": 1}, elastic_resize_monitor_interval_s=0),
            step_sleep=0.1)
        t.join()
    state = _state(storage_path)
    assert state["status"] == "finished" and [a["workers"] for a in state["attempts"]] == [3, 2, 3]
    uses = data_jobs.uses_per_epoch(events)["shard"]
    assert all(sorted(counts.elements()) == list(range(data_jobs.ROWS)) for counts in uses.values()) and len(uses) == 6
    (alone,) = [e["weights"] for e in read_events(alone_events) if e["event"] == "weights"]
    (resized,) = [e["weights"] for e in read_events(events) if e["event"] == "weights"]
    assert resized == alone
