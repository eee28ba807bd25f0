"""Durable runs with real processes: driver kill -9 and relaunch, the lease, crashes at
every step of the checkpoint commit, corrupted files, asynchronous uploads."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from outlast.storage import open_storage
from outlast.storage.restore import verify
from outlast.storage.run_store import RunStore
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from outlast.errors import RunInUseError
from tests.integration.jobs import counting_loop, read_events
from tests.integration.procs import alive, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _driver(storage_path, events, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.driver", str(storage_path), str(events), *args],
        cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _state(storage_path, name="run") -> dict:
    return json.loads((Path(storage_path) / name / "run_state.json").read_text())


def _fit(storage_path, events, name="run", **config):
    cfg = {"events": str(events), "steps": 12, "every": 5, **config}
    return Trainer(counting_loop, train_loop_config=cfg, scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name=name, storage_path=str(storage_path),
                                        failure_config=FailureConfig(max_failures=1))).fit()


def assert_every_checkpoint_whole(storage_path, name="run") -> None:
    """Every checkpoint the run state names verifies, and nothing without a manifest is left."""
    store = RunStore(open_storage(storage_path), name)
    state = store.load_state()
    for record in state.checkpoints:
        manifest = store.read_manifest(record.checkpoint_dir)
        assert manifest is not None, record.checkpoint_dir
        verify(Path(storage_path) / name / record.checkpoint_dir, manifest)
    for d in store.checkpoint_dirs():
        assert (Path(storage_path) / name / d / ".outlast-manifest.json").exists(), f"{d} has no manifest"


def _kill_after_checkpoint_9(storage_path, events) -> list[str]:
    """Run a driver until the checkpoint of step 9 is committed, SIGKILL it; return its arguments."""
    args = ["--name", "run", "--loop", "counting_loop", "--steps", "30", "--step-sleep", "0.05"]
    first = _driver(storage_path, events, *args)
    # The run state, not only the manifest: between the two writes the state still names step 4.
    wait_until(lambda: _latest_index(storage_path) >= 9, 60, "the run state to name the checkpoint of step 9")
    first.kill()
    first.wait()
    return args


def _latest_index(storage_path) -> int:
    try:
        latest = _state(storage_path)["latest_checkpoint"]
    except (FileNotFoundError, ValueError):
        return -1
    return int(latest.rsplit("_", 1)[1]) if latest else -1


def _restored(events, attempt):
    return {e["restored_step"] for e in read_events(events) if e["event"] == "start" and e["attempt"] == attempt}


def test_a_driver_killed_with_sigkill_is_relaunched_and_continues_from_the_latest_checkpoint(storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    first = _driver(storage_path, events, "--name", "run", "--loop", "counting_loop", "--steps", "40",
                    "--step-sleep", "0.05")
    wait_until(lambda: any(e.get("step", 0) >= 17 for e in read_events(events)), 60, "step 17")
    first.kill()
    first.wait()
    latest = _state(storage_path)["latest_checkpoint"]
    latest_step = json.loads((Path(storage_path) / "run" / latest / "state.json").read_text())["step"]
    second = _driver(storage_path, events, "--name", "run", "--loop", "counting_loop", "--steps", "40")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"step": 39}
    assert _restored(events, 2) == {latest_step}
    state = _state(storage_path)
    assert [a["outcome"] for a in state["attempts"]] == ["driver_lost", "finished"]
    assert state["failure_counts"] == {"driver": 1}
    assert_every_checkpoint_whole(storage_path)


def test_a_second_live_driver_is_refused_naming_the_first(storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    first = _driver(storage_path, events, "--name", "run")
    try:
        wait_until(lambda: len(read_events(events)) == 2, 60, "the first driver's workers")
        with pytest.raises(RunInUseError, match=f"pid {first.pid}"):
            _fit(storage_path, tmp_path / "other.jsonl")
        assert first.poll() is None  # the first run is untouched
    finally:
        first.kill()
        first.wait()


def test_relaunching_a_finished_run_returns_its_result_without_training_again(storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    first = _fit(storage_path, events)
    seen = len(read_events(events))
    again = _fit(storage_path, events)
    assert again.last_metrics == first.last_metrics == {"step": 11}
    assert again.checkpoint == first.checkpoint
    assert len(read_events(events)) == seen


# (fault point, process it kills, step restored by the next attempt: None = from scratch)
COMMIT_FAULTS = [
    ("upload.mid", "worker", None),
    ("report.after_upload", "worker", None),
    ("report.after_commit", "worker", 4),
    ("commit.before_manifest", "driver", None),
    ("commit.after_manifest", "driver", 4),
    ("commit.after_run_state", "driver", 4),
]


@pytest.mark.parametrize("point,victim,restored", COMMIT_FAULTS)
def test_a_crash_at_any_step_of_the_commit_restores_a_whole_checkpoint(point, victim, restored, storage_path,
                                                                       tmp_path):
    events = tmp_path / "events.jsonl"
    env = {"OUTLAST_FAULT_POINTS": f"{point}=kill"}
    args = ["--name", "run", "--loop", "counting_loop", "--steps", "12", "--max-failures", "1"]
    first = _driver(storage_path, events, *args, env=env)
    out, err = first.communicate(timeout=120)
    if victim == "driver":
        assert first.returncode == -signal.SIGKILL
        second = _driver(storage_path, events, *args)
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
    else:
        assert first.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"step": 11}
    assert _restored(events, 2) == {restored}
    assert_every_checkpoint_whole(storage_path)
    latest = Path(storage_path) / "run" / _state(storage_path)["latest_checkpoint"]
    assert json.loads((latest / "state.json").read_text()) == {"step": 9}


# A named checkpoint left half-uploaded by a dead worker, or committed by a driver killed before its run
# state named it: the next attempt tells both for checkpoints by their marker, so it neither trips over the
# name when it reports it again nor restores from scratch. The user's own directory beside them stays.
NAMED_COMMIT_FAULTS = [("upload.mid", "worker", None), ("report.after_commit", "worker", 4),
                       ("commit.after_manifest", "driver", 4)]


@pytest.mark.parametrize("point,victim,restored", NAMED_COMMIT_FAULTS)
def test_a_crash_mid_commit_of_a_named_checkpoint_restores_it_by_its_name(point, victim, restored, storage_path,
                                                                          tmp_path):
    events = tmp_path / "events.jsonl"
    own = Path(storage_path) / "run" / "notes"
    own.mkdir(parents=True)
    (own / "todo.txt").write_text("mine")
    args = ["--name", "run", "--loop", "counting_loop", "--steps", "12", "--max-failures", "1", "--named"]
    first = _driver(storage_path, events, *args, env={"OUTLAST_FAULT_POINTS": f"{point}=kill"})
    out, err = first.communicate(timeout=120)
    if victim == "driver":
        assert first.returncode == -signal.SIGKILL
        second = _driver(storage_path, events, *args)
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
    else:
        assert first.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"step": 11}
    assert _restored(events, 2) == {restored}
    state = _state(storage_path)
    assert [c["checkpoint_dir"] for c in state["checkpoints"]] == ["step_4", "step_9"]
    assert state["latest_checkpoint"] == "step_9"
    assert json.loads((Path(storage_path) / "run" / "step_9" / "state.json").read_text()) == {"step": 9}
    assert_every_checkpoint_whole(storage_path)
    assert (own / "todo.txt").read_text() == "mine"
    shown = subprocess.run([sys.executable, "-m", "outlast.cli.main", "runs", str(storage_path), "run"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "  step_4  " in shown.stdout and re.search(r"  step_9  .*<- latest", shown.stdout), shown.stdout


def test_a_corrupted_checkpoint_file_falls_back_to_the_previous_checkpoint(storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    args = _kill_after_checkpoint_9(storage_path, events)
    latest = Path(storage_path) / "run" / _state(storage_path)["latest_checkpoint"]
    data = bytearray((latest / "state.json").read_bytes())
    digit = data.index(b"}") - 1
    data[digit] = ord("0") if data[digit] != ord("0") else ord("1")  # same size, other bytes
    (latest / "state.json").write_bytes(bytes(data))
    second = _driver(storage_path, events, *args)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    state = _state(storage_path)
    skipped = state["skipped_checkpoints"]
    assert [s["checkpoint_dir"] for s in skipped] == [latest.name]
    assert "does not match its checksum" in skipped[0]["reason"]
    restored = [e["restored_step"] for e in read_events(events) if e["event"] == "start" and e["attempt"] == 3]
    assert restored and restored[0] is not None and restored[0] < int(latest.name.rsplit("_", 1)[1])
    assert "worker" not in state["failure_counts"]  # a bad checkpoint is not the workers' failure


def test_a_vanished_checkpoint_is_skipped_and_the_previous_one_restored(storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    args = _kill_after_checkpoint_9(storage_path, events)
    latest = _state(storage_path)["latest_checkpoint"]
    shutil.rmtree(Path(storage_path) / "run" / latest)
    second = _driver(storage_path, events, *args)
    _, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    skipped = _state(storage_path)["skipped_checkpoints"]
    assert skipped[0]["checkpoint_dir"] == latest and "gone" in skipped[0]["reason"]
    assert "cannot be restored" in err


def test_a_corrupted_run_state_is_set_aside_and_rebuilt_from_the_manifests(storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    args = _kill_after_checkpoint_9(storage_path, events)
    (Path(storage_path) / "run" / "run_state.json").write_text("{ this is not json")
    second = _driver(storage_path, events, *args)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert "rebuilt the run's history" in err
    assert list((Path(storage_path) / "run").glob("run_state.json.corrupt-*"))
    assert min(_restored(events, 2) - {None}) >= 9


def test_asynchronous_uploads_commit_and_clean_up_their_local_directories(storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    result = _fit(storage_path, events, upload_mode="ASYNC")
    assert result.last_metrics == {"step": 11}
    assert Path(result.checkpoint.path).name == "checkpoint_001_000009"
    assert_every_checkpoint_whole(storage_path)
    assert [c["checkpoint_dir"] for c in _state(storage_path)["checkpoints"]] == [
        "checkpoint_001_000004", "checkpoint_001_000009"]


def test_an_unknown_upload_mode_is_refused_by_name(storage_path, tmp_path):
    with pytest.raises(Exception) as info:
        _fit(storage_path, tmp_path / "e.jsonl", upload_mode="EVENTUALLY")
    assert "EVENTUALLY" in str(info.value)


def test_outlast_runs_lists_runs_and_shows_a_history_at_a_glance(storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    fault = {"rank": 1, "step": 7, "when": "before_report", "kind": "raise"}
    _fit(storage_path, events, fault=fault)
    cli = [sys.executable, "-m", "outlast.cli.main", "runs", str(storage_path)]
    listing = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0
    header, row = listing.stdout.splitlines()[:2]
    assert header.split()[:2] == ["run", "status"]
    assert row.split()[1:5] == ["finished", "2", "1", "2"]
    detail = subprocess.run(cli + ["run"], capture_output=True, text=True, timeout=60)
    assert "rank 1 pid" in detail.stdout and "RuntimeError: injected failure at step 7" in detail.stdout
    assert "restored from checkpoint_001_000004" in detail.stdout and "<- latest" in detail.stdout
    missing = subprocess.run(cli + ["nope"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "no run at" in missing.stderr


def test_a_relaunched_driver_on_a_running_node_retires_its_predecessors_workers_at_once(storage_path, tmp_path):
    cli = [sys.executable, "-m", "outlast.cli.main"]
    assert subprocess.run(cli + ["start", "--preload", ""], cwd=ROOT, capture_output=True).returncode == 0
    try:
        events = tmp_path / "events.jsonl"
        args = ["--name", "run", "--loop", "counting_loop", "--steps", "100000", "--step-sleep", "0.05"]
        # Without the relaunch, the node would keep these workers for a minute (the heartbeat timeout).
        first = _driver(storage_path, events, *args, env={"OUTLAST_DRIVER_TIMEOUT_S": "60"})
        wait_until(lambda: len(_pids(events, attempt=1)) == 2, 60, "the first driver's workers")
        old = _pids(events, attempt=1)
        first.kill()
        first.wait()
        second = _driver(storage_path, events, *args)
        try:
            wait_until(lambda: len(_pids(events, attempt=2)) == 2, 60, "the relaunched driver's workers")
            wait_until(lambda: not any(alive(p) for p in old), 5, f"the old workers {old} to be killed")
        finally:
            second.kill()
            second.wait()
    finally:
        subprocess.run(cli + ["stop"], cwd=ROOT, capture_output=True)


def _pids(events, attempt):
    return {e["pid"] for e in read_events(events) if e["event"] == "start" and e["attempt"] == attempt}
