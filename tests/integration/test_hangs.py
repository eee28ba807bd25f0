"""A hang on real processes: one rank sleeps forever between two gloo all_reduces while the other waits in
all_reduce. It is found within hang_timeout_s, explained from both ranks' stacks, and restarted as a failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from outlast.train import FailureConfig, RunConfig, ScalingConfig
from tests.integration.elastic_jobs import wedging_loop
from tests.integration.jobs import read_events

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.torch
def test_a_rank_asleep_while_its_peer_waits_in_all_reduce_is_dumped_explained_and_restarted(
        storage_path, tmp_path, monkeypatch):
    from outlast.train.torch import TorchTrainer

    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("OUTLAST_TEST_EVENTS", str(events))
    TorchTrainer(wedging_loop, train_loop_config={"events": str(events), "steps": 20, "wedge_at": 5},
                 scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name="run", storage_path=storage_path,
                                      failure_config=FailureConfig(max_failures=1, hang_timeout_s=3))).fit()
    state = json.loads((Path(storage_path) / "run" / "run_state.json").read_text())
    assert state["status"] == "finished" and state["failure_counts"] == {"worker": 1}
    (hang,) = state["hangs"]
    assert hang["attempt"] == 1
    summary = hang["summary"]
    assert "made no progress for" in summary and "FailureConfig.hang_timeout_s=3" in summary
    assert "rank 1 is in sleep_forever (elastic_jobs.py:" in summary
    assert "while rank 0 waits in all_reduce (" in summary
    by_rank = {r: g for g in hang["stacks"] for r in g["ranks"]}
    assert set(by_rank) == {0, 1}
    assert "all_reduce" in by_rank[0]["text"] and "wedging_loop" in by_rank[0]["text"]
    assert "sleep_forever" in by_rank[1]["text"] and "outlast/train/watch.py" in by_rank[1]["text"]  # all threads
    failure = state["attempts"][0]["failures"][0]
    assert failure["kind"] == "Hang" and failure["exc_type"] is None and failure["message"] == summary
    assert failure["rank"] == 1  # the rank that is wedged, not the first found without progress
    assert [e["attempt"] for e in read_events(events) if e["event"] == "end"] == [2, 2]
    shown = subprocess.run([sys.executable, "-m", "outlast.cli.main", "runs", storage_path, "run"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert "hang in attempt 1" in shown.stdout and "rank 1 in sleep_forever" in shown.stdout
