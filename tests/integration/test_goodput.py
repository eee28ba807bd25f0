"""Goodput on real runs (outlast/storage/goodput.py): a kill, a hang, a drain and a resize each cost the part they
should, and on every run the parts add up to the wall time its attempts held their workers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from outlast.storage import open_storage
from outlast.storage.goodput import GOODPUT_VERSION, PARTS, Goodput, split
from outlast.storage.run_store import RunStore
from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.jobs import counting_loop, preemptible_loop, read_events
from tests.integration.live_jobs import live_loop
from tests.integration.procs import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _goodput(storage_path: str) -> Goodput:
    store = RunStore(open_storage(storage_path), "run")
    state = store.load_state()
    assert state is not None and all(a.ended_at is not None for a in state.attempts)
    g = split(state, {a.attempt: store.read_reports(a.attempt) for a in state.attempts}, now=time.time())
    held = sum(a.ended_at - a.started_at for a in state.attempts)  # type: ignore[operator]
    assert math.isclose(sum(g.parts().values()), held, rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(g.held_s, held, rel_tol=1e-9, abs_tol=1e-9)
    assert all(v >= 0 for v in g.parts().values()) and g.productive_s > 0 and g.steps > 0
    return g


def _fit(loop, storage_path, config: dict, workers=2, **failure) -> None:
    Trainer(loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=workers),
            run_config=RunConfig(name="run", storage_path=storage_path,
                                 failure_config=FailureConfig(**failure))).fit()


def test_a_killed_rank_costs_a_restart_and_the_steps_trained_again_and_runs_json_says_so(storage_path, tmp_path):
    # Checkpoints at steps 4 and 9; the kill before step 7's report loses steps 5 and 6, trained again.
    fault = {"rank": 1, "step": 7, "when": "before_report", "kind": "kill"}
    _fit(counting_loop, storage_path, {"events": str(tmp_path / "e.jsonl"), "steps": 12, "every": 5,
                                       "step_sleep": 0.05, "fault": fault}, max_failures=1)
    g = _goodput(storage_path)
    assert g.restarts_s > 0 and g.startup_s > 0 and g.checkpoint_stalls_s > 0 and g.ending_s > 0
    # Attempt 2 restores step 4 and reports steps 5 on; its first report closes its restart, and each report after
    # it up to the furthest attempt 1 reached (step 6, or step 7 when rank 0's report of it beat the kill) is a
    # step trained again.
    reached = len(RunStore(open_storage(storage_path), "run").read_reports(1))
    assert reached in (7, 8) and g.replayed_steps == reached - 6 and g.replayed_s > 0
    assert g.hangs_s == g.drains_s == g.waiting_s == g.in_flight_s == 0
    shown = subprocess.run([sys.executable, "-m", "outlast.cli.main", "runs", storage_path, "run", "--json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    doc = json.loads(shown.stdout)["goodput"]
    assert doc["version"] == GOODPUT_VERSION and math.isclose(sum(doc[f"{p}_s"] for p in PARTS), doc["held_s"], rel_tol=1e-9)
    assert doc["replayed_steps"] == g.replayed_steps
    text = subprocess.run([sys.executable, "-m", "outlast.cli.main", "runs", storage_path, "run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60).stdout
    assert "goodput: " in text and "steps trained again" in text and "restarts" in text


@pytest.mark.torch
def test_a_live_recovery_is_a_part_of_its_own_and_not_one_long_step(storage_path, tmp_path):
    from outlast.train.torch import TorchTrainer

    TorchTrainer(live_loop, train_loop_config={"events": str(tmp_path / "e.jsonl"), "steps": 10,
                                               "kill": [[1, 4, "kill"]], "report": True},
                 scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name="run", storage_path=storage_path,
                                      failure_config=FailureConfig(max_failures=1, live_recovery=True))).fit()
    g = _goodput(storage_path)
    state = RunStore(open_storage(storage_path), "run").load_state()
    assert state is not None and [r.path for r in state.live_recoveries] == ["live"]
    recovery = state.live_recoveries[0]
    # From the last report before the death (the step thrown away) to the state received: at least the recovery's
    # own seconds, and no restart, since the attempt went on.
    assert g.live_recoveries_s >= recovery.seconds and g.live_recoveries_s > 0  # type: ignore[operator]
    assert g.restarts_s == g.replayed_s == 0 and len(state.attempts) == 1
    shown = subprocess.run([sys.executable, "-m", "outlast.cli.main", "runs", storage_path, "run", "--json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    doc = json.loads(shown.stdout)["goodput"]
    assert doc["version"] == GOODPUT_VERSION and doc["live_recoveries_s"] == g.live_recoveries_s
    text = subprocess.run([sys.executable, "-m", "outlast.cli.main", "runs", storage_path, "run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60).stdout
    assert "live recoveries" in text


def test_a_hang_is_charged_until_its_detection(storage_path, tmp_path):
    # Rank 1 holds before step 3's report while rank 0 waits for it at the next barrier.
    fault = {"rank": 1, "step": 3, "when": "before_report", "kind": "hold"}
    _fit(counting_loop, storage_path, {"events": str(tmp_path / "e.jsonl"), "steps": 6, "every": 2,
                                       "step_sleep": 0.05, "fault": fault}, max_failures=1, hang_timeout_s=1)
    g = _goodput(storage_path)
    assert g.hangs_s > 0 and g.restarts_s > 0


def test_a_drain_is_charged_to_drains_and_not_to_restarts(storage_path, tmp_path):
    events = tmp_path / "e.jsonl"
    with LocalCluster(num_nodes=2, cpus_per_node=1) as cluster:
        def drain() -> None:
            wait_until(lambda: any(e.get("step", -1) >= 5 for e in read_events(events)), 120, "step 5")
            (start,) = [e for e in read_events(events) if e["event"] == "start"]
            cluster.drain_node(start["node_id"], deadline_s=10)

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        Trainer(preemptible_loop, train_loop_config={"events": str(events), "steps": 30, "step_sleep": 0.05},
                scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
                run_config=RunConfig(name="run", storage_path=storage_path)).fit()
        t.join()
    g = _goodput(storage_path)
    assert g.drains_s > 0 and g.restarts_s == 0 and g.hangs_s == 0


def test_a_resize_after_a_lost_node_is_a_restart(storage_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "e.jsonl"
    with LocalCluster(num_nodes=2, cpus_per_node=1, node_timeout_s=2) as cluster:
        def lose() -> None:
            wait_until(lambda: any(e.get("step", -1) >= 5 for e in read_events(events)), 120, "step 5")
            cluster.kill_node("node-1")

        t = threading.Thread(target=lose, daemon=True)
        t.start()
        Trainer(counting_loop, train_loop_config={"events": str(events), "steps": 20, "every": 4,
                                                  "step_sleep": 0.05},
                scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1},
                                             elastic_resize_monitor_interval_s=0),
                run_config=RunConfig(name="run", storage_path=storage_path,
                                     failure_config=FailureConfig(max_failures=0))).fit()
        t.join()
    state = msgspec.json.decode((Path(storage_path) / "run" / "run_state.json").read_bytes())
    assert [a["workers"] for a in state["attempts"]] == [2, 1] and state["attempts"][0]["outcome"] == "resized"
    g = _goodput(storage_path)
    assert g.restarts_s > 0
