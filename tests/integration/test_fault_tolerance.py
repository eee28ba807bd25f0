"""Worker failures against real processes: exceptions, SIGKILL, budgets, commits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outlast.storage.records import MANIFEST_NAME
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer, TrainingFailedError
from tests.integration.jobs import counting_loop, ddp_loop, read_events
from tests.integration.procs import alive


def _fit(loop, storage_path, tmp_path, *, workers=2, max_failures=0, trainer=Trainer, **config):
    events = str(tmp_path / "events.jsonl")
    config = {"events": events, "steps": 12, "every": 5, **config}
    result = trainer(
        loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(name="run", storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures)),
    ).fit()
    return result, read_events(events)


def _run_state(storage_path) -> dict:
    return json.loads((Path(storage_path) / "run" / "run_state.json").read_text())


def _starts(events):
    return [e for e in events if e["event"] == "start"]


def test_a_rank_that_raises_is_retried_and_its_traceback_reaches_the_driver(storage_path, tmp_path):
    fault = {"rank": 1, "step": 7, "when": "before_report", "kind": "raise"}
    result, events = _fit(counting_loop, storage_path, tmp_path, max_failures=1, fault=fault)
    assert result.last_metrics == {"step": 11}
    restarted = [s for s in _starts(events) if s["attempt"] == 2]
    assert {s["restored_step"] for s in restarted} == {4}  # the checkpoint of step 4, committed before the fault
    failure = _run_state(storage_path)["attempts"][0]["failures"][0]
    assert failure["rank"] == 1 and failure["exc_type"] == "RuntimeError"
    assert "injected failure at step 7" in failure["traceback"] and "_fault" in failure["traceback"]


def test_an_exhausted_budget_raises_with_every_cause(storage_path, tmp_path):
    fault = {"rank": 0, "step": 2, "when": "before_report", "kind": "raise", "attempts": 99}
    with pytest.raises(TrainingFailedError) as info:
        _fit(counting_loop, storage_path, tmp_path, max_failures=2, fault=fault)
    err = info.value
    roots = [f for f in err.failures if f.rank == 0]
    assert [f.attempt for f in roots] == [1, 2, 3]
    assert all("injected failure at step 2" in f.traceback for f in roots)
    assert "max_failures=2" in str(err) and "attempt 3" in str(err)
    assert _run_state(storage_path)["status"] == "errored"


def test_max_failures_minus_one_retries_until_the_run_succeeds(storage_path, tmp_path):
    fault = {"rank": 1, "step": 1, "when": "before_report", "kind": "kill", "attempts": 3}
    result, events = _fit(counting_loop, storage_path, tmp_path, max_failures=-1, fault=fault)
    assert result.last_metrics == {"step": 11}
    assert max(s["attempt"] for s in _starts(events)) == 4
    assert _run_state(storage_path)["failure_counts"] == {"worker": 3}


def test_a_worker_killed_right_after_report_returned_restores_that_checkpoint(storage_path, tmp_path):
    # Rank 0's report(checkpoint=...) for step 4 has returned when it kills itself: the checkpoint
    # is committed and must be what the next attempt restores (not step -1, not a later one).
    fault = {"rank": 0, "step": 4, "when": "after_report", "kind": "kill"}
    result, events = _fit(counting_loop, storage_path, tmp_path, max_failures=1, fault=fault)
    assert {s["restored_step"] for s in _starts(events) if s["attempt"] == 2} == {4}
    assert result.last_metrics == {"step": 11}


def test_a_sharded_checkpoint_commits_only_with_every_shard(storage_path, tmp_path):
    fault = {"rank": 1, "step": 4, "when": "after_report", "kind": "kill"}
    result, events = _fit(counting_loop, storage_path, tmp_path, max_failures=1, fault=fault, sharded=True)
    assert {s["restored_step"] for s in _starts(events) if s["attempt"] == 2} == {4}
    manifest = json.loads((Path(result.checkpoint.path) / MANIFEST_NAME).read_text())
    assert manifest["ranks"] == [0, 1]
    assert {f["path"] for f in manifest["files"]} == {"state.json", "state_rank0.json", "state_rank1.json"}


def test_a_directory_without_a_manifest_is_never_restored(storage_path, tmp_path):
    # A newer-looking checkpoint directory whose upload never committed (no manifest).
    run_dir = Path(storage_path) / "run"
    bogus = run_dir / "checkpoint_001_000008"
    bogus.mkdir(parents=True)
    (bogus / "state.json").write_text(json.dumps({"step": 8}))
    fault = {"rank": 1, "step": 7, "when": "before_report", "kind": "kill"}
    result, events = _fit(counting_loop, storage_path, tmp_path, max_failures=1, fault=fault)
    assert {s["restored_step"] for s in _starts(events) if s["attempt"] == 2} == {4}
    assert not bogus.exists()
    assert result.last_metrics == {"step": 11}


def test_metrics_and_checkpoint_of_a_clean_run_are_in_the_result(storage_path, tmp_path):
    result, events = _fit(counting_loop, storage_path, tmp_path, workers=3)
    assert result.last_metrics == {"step": 11}
    assert result.metrics == {"step": 9}  # as on Ray V2: the metrics reported with the latest checkpoint
    assert Path(result.checkpoint.path).name == "checkpoint_001_000009"
    assert json.loads((Path(result.checkpoint.path) / "state.json").read_text()) == {"step": 9}
    assert sorted({e["rank"] for e in events}) == [0, 1, 2]
    state = _run_state(storage_path)
    assert state["status"] == "finished" and state["latest_checkpoint"] == "checkpoint_001_000009"
    assert [c["checkpoint_dir"] for c in state["checkpoints"]] == ["checkpoint_001_000004", "checkpoint_001_000009"]


@pytest.mark.torch
def test_sigkill_of_a_ddp_worker_resumes_from_the_latest_checkpoint(storage_path, tmp_path):
    from outlast.train.torch import TorchTrainer

    fault = {"rank": 1, "step": 13, "when": "before_report", "kind": "kill"}
    result, events = _fit(ddp_loop, storage_path, tmp_path, max_failures=2, trainer=TorchTrainer, steps=20,
                          fault=fault)
    assert result.last_metrics["step"] == 19
    assert {s["restored_step"] for s in _starts(events) if s["attempt"] == 2} == {9}
    second = [e["step"] for e in events if e["event"] == "step" and e["attempt"] == 2 and e["rank"] == 0]
    assert second == list(range(10, 20))
    failure = _run_state(storage_path)["attempts"][0]["failures"][0]
    assert failure["rank"] == 1 and failure["signal"] == 9
    killed = {e["pid"] for e in events if e["event"] == "fault"}
    assert killed and all(not alive(pid) for pid in killed)
