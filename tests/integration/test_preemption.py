"""Preemption on one node: a drain reaches every rank on the same call, the loop saves one
just-in-time checkpoint, and the run says clearly that it waits for capacity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from outlast.train import FailureConfig, PreemptionError, RunConfig, ScalingConfig, Trainer, TrainingFailedError
from tests.integration.jobs import preemptible_loop, read_events
from tests.integration.procs import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _outlast(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "outlast.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def node():
    started = _outlast("start", "--preload", "")
    assert started.returncode == 0, started.stderr
    status = _outlast("status").stdout
    yield status.split()[1]  # "node <id> ..."
    _outlast("stop")


def _drain_when(events, step, node_id, deadline_s=6):
    def run():
        wait_until(lambda: any(e.get("step", -1) >= step for e in read_events(events)), 60, f"step {step}")
        done = _outlast("drain-node", "--node-id", node_id, "--reason", "preemption", "--reason-message",
                        "spot instance reclaimed", "--deadline-remaining-seconds", str(deadline_s))
        assert done.returncode == 0, done.stderr

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _fit(storage_path, events, **failure):
    return Trainer(preemptible_loop, train_loop_config={"events": str(events), "steps": 10_000, "step_sleep": 0.02},
                   scaling_config=ScalingConfig(num_workers=3),
                   run_config=RunConfig(name="run", storage_path=storage_path,
                                        failure_config=FailureConfig(**failure))).fit()


def test_a_drain_reaches_every_rank_on_the_same_call_and_the_jit_checkpoint_is_committed(
        node, storage_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_CAPACITY_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    drainer = _drain_when(events, 10, node)
    started = time.time()
    with pytest.raises(TrainingFailedError) as info:
        _fit(storage_path, events)
    drainer.join()
    notices = [e for e in read_events(events) if e["event"] == "notice"]
    assert sorted(e["rank"] for e in notices) == [0, 1, 2]
    assert len({e["call"] for e in notices}) == 1 and len({e["step"] for e in notices}) == 1
    n = notices[0]
    assert n["node_ids"] == [node] and n["ranks"] == [0, 1, 2] and n["reason"] == "preemption"
    assert started + 5 < n["deadline_ms"] / 1000 < time.time() + 6
    state = json.loads((Path(storage_path) / "run" / "run_state.json").read_text())
    latest = Path(storage_path) / "run" / state["latest_checkpoint"]
    assert json.loads((latest / "state.json").read_text()) == {"step": n["step"]}  # no step lost
    assert state["failure_counts"] == {"preemption": 1}
    assert state["attempts"][0]["failures"][0]["kind"] == "Preemption"
    assert "no capacity" in str(info.value) and "draining" in str(info.value)


def test_a_spent_preemption_budget_raises_preemption_error(node, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    drainer = _drain_when(events, 5, node)
    with pytest.raises(PreemptionError, match="max_preemption_failures=0"):
        _fit(storage_path, events, max_preemption_failures=0)
    drainer.join()
    assert len([e for e in read_events(events) if e["event"] == "notice"]) == 3


def test_drain_node_refuses_an_unknown_node_id(node):
    refused = _outlast("drain-node", "--node-id", "not-" + node)
    assert refused.returncode == 1 and f"this machine's node is '{node}'" in refused.stderr
    assert "draining" not in _outlast("status").stdout


def test_sigterm_to_a_blocking_node_drains_it_before_it_stops(storage_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "3")
    monkeypatch.setenv("OUTLAST_CAPACITY_TIMEOUT_S", "3")
    agent = subprocess.Popen([sys.executable, "-m", "outlast.cli.main", "start", "--block", "--preload", ""],
                             cwd=ROOT, env={**os.environ, "OUTLAST_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "6"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _outlast("status").returncode == 0, 30, "the node to start")
        events = tmp_path / "events.jsonl"

        def sigterm_at_step_5():
            wait_until(lambda: any(e.get("step", -1) >= 5 for e in read_events(events)), 60, "step 5")
            agent.terminate()

        threading.Thread(target=sigterm_at_step_5, daemon=True).start()
        with pytest.raises(TrainingFailedError):
            _fit(storage_path, events)
        notices = [e for e in read_events(events) if e["event"] == "notice"]
        assert sorted(e["rank"] for e in notices) == [0, 1, 2] and notices[0]["reason"] == "shutdown"
        state = json.loads((Path(storage_path) / "run" / "run_state.json").read_text())
        latest = Path(storage_path) / "run" / state["latest_checkpoint"]
        assert json.loads((latest / "state.json").read_text()) == {"step": notices[0]["step"]}
        # With nowhere to move, the workers trained on until the drain deadline; then the node left.
        assert agent.wait(timeout=30) == 0
    finally:
        agent.kill()


def test_a_cloud_preemption_notice_drains_the_node(tmp_path):
    from tests.integration.test_cloud_watchers import FakeImds

    imds = FakeImds()
    try:
        started = _outlast("start", "--preload", "", "--preemption-watchers", "aws", "--metadata-url",
                           f"aws={imds.url}")
        assert started.returncode == 0, started.stderr
        assert "draining" not in _outlast("status").stdout
        deadline = time.gmtime(time.time() + 120)
        imds.interruption = {"action": "terminate", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", deadline)}
        wait_until(lambda: "draining: preemption (aws:" in _outlast("status").stdout, 30, "the node to drain")
        assert "deadline in 1" in _outlast("status").stdout  # about 120 s away
    finally:
        _outlast("stop")
        imds.close()


def test_an_unknown_cloud_is_refused_at_start():
    refused = _outlast("start", "--preload", "", "--preemption-watchers", "aws,oracle")
    assert refused.returncode == 2 and "unknown cloud oracle" in refused.stderr
