"""Runs on S3 through a real S3-protocol server on loopback (moto in server mode),
through the same client code users run; and a file system that fills up."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from outlast.storage import open_storage
from outlast.storage.records import MANIFEST_NAME
from outlast.storage.run_store import RunStore
from outlast.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig, Trainer, TrainingFailedError
from tests.integration.jobs import counting_loop, read_events


def _fit(storage_path, events, **config):
    cfg = {"events": str(events), "steps": 12, "every": 5, **config}
    return Trainer(counting_loop, train_loop_config=cfg, scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name="run", storage_path=storage_path,
                                        failure_config=FailureConfig(max_failures=1))).fit()


def test_a_run_on_s3_restores_from_a_checkpoint_in_the_bucket(s3, tmp_path):
    events = tmp_path / "events.jsonl"
    fault = {"rank": 1, "step": 7, "when": "before_report", "kind": "kill"}
    result = _fit("s3://runs/experiments", events, fault=fault)
    assert result.last_metrics == {"step": 11}
    assert result.path == "s3://runs/experiments/run"
    assert result.checkpoint.path == "s3://runs/experiments/run/checkpoint_002_000004"
    restored = {e["restored_step"] for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2}
    assert restored == {4}
    with result.checkpoint.as_directory() as d:
        assert json.loads((Path(d) / "state.json").read_text()) == {"step": 9}
        assert not (Path(d) / MANIFEST_NAME).exists()
    store = RunStore(open_storage("s3://runs/experiments"), "run")
    state = store.load_state()
    assert state.status == "finished" and state.failure_counts == {"worker": 1}
    assert store.read_manifest(state.latest_checkpoint).ranks == [0]


def test_asynchronous_uploads_to_s3_commit(s3, tmp_path):
    result = _fit("s3://runs/async", tmp_path / "events.jsonl", upload_mode="ASYNC")
    assert result.checkpoint.path.endswith("checkpoint_001_000009")
    local = Checkpoint(result.checkpoint.path).to_directory(tmp_path / "copy")
    assert json.loads((Path(local) / "state.json").read_text()) == {"step": 9}


def test_an_s3_outage_during_training_is_ridden_out_by_upload_retries(s3, tmp_path):
    events = tmp_path / "events.jsonl"

    def outage():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(e.get("step") == 5 for e in read_events(events)):
            time.sleep(0.01)
        s3.stop()
        time.sleep(1.0)
        s3.start()

    t = threading.Thread(target=outage)
    t.start()
    result = _fit("s3://runs/outage", events, steps=20, step_sleep=0.05)
    t.join()
    assert result.last_metrics == {"step": 19}
    state = RunStore(open_storage("s3://runs/outage"), "run").load_state()
    assert [c.report_index for c in state.checkpoints] == [4, 9, 14, 19]


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    # The run's last state cannot be written either: the controller retries it for the storage budget, which a
    # full disk does not outlast here.
    monkeypatch.setenv("OUTLAST_STORAGE_RETRY_S", "3")
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    try:
        events = tmp_path / "events.jsonl"
        # Each checkpoint carries ~100 KiB of padding: the third one does not fit.
        with pytest.raises(TrainingFailedError) as info:
            _fit(str(mount), events, steps=30, pad_bytes=100 * 1024)
        assert "No space left on device" in str(info.value.root_cause.message)
        store = RunStore(open_storage(str(mount)), "run")
        state = store.load_state()
        assert state.latest_checkpoint is not None
        manifest = store.read_manifest(state.latest_checkpoint)
        from outlast.storage.restore import verify

        verify(mount / "run" / state.latest_checkpoint, manifest)
        assert all((d / MANIFEST_NAME).exists() for d in (mount / "run").glob("checkpoint_*"))
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _stop_at_step(s3, events, step: int, outage_s: float | None):
    def outage():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(e.get("step") == step for e in read_events(events)):
            time.sleep(0.01)
        s3.stop()
        if outage_s is not None:
            time.sleep(outage_s)
            s3.start()

    t = threading.Thread(target=outage)
    t.start()
    return t


def test_an_s3_outage_of_a_few_seconds_is_ridden_out_by_the_controllers_retries_too(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_UPLOAD_TRIES", "10")  # the ranks' uploads wait it out as well
    events = tmp_path / "events.jsonl"
    t = _stop_at_step(s3, events, 4, outage_s=4.0)  # as checkpoint 4's manifest is written
    result = _fit("s3://runs/short-outage", events, steps=15, step_sleep=0.05)
    t.join()
    assert result.last_metrics == {"step": 14}
    state = RunStore(open_storage("s3://runs/short-outage"), "run").load_state()
    assert state.status == "finished" and [c.report_index for c in state.checkpoints] == [4, 9, 14]


def test_an_s3_outage_longer_than_the_retries_fails_the_run_saying_storage_failed(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_STORAGE_RETRY_S", "3")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries would stretch each call
    monkeypatch.setenv("OUTLAST_UPLOAD_TRIES", "1")  # the rank's checkpoint upload fails at once: the controller's
    events = tmp_path / "events.jsonl"                # retries are what this test is about
    t = _stop_at_step(s3, events, 4, outage_s=None)
    try:
        with pytest.raises(TrainingFailedError) as failed:
            Trainer(counting_loop, train_loop_config={"events": str(events), "steps": 200, "every": 5,
                                                      "step_sleep": 0.05},
                    scaling_config=ScalingConfig(num_workers=2),
                    run_config=RunConfig(name="run", storage_path="s3://runs/long-outage",
                                         failure_config=FailureConfig(max_failures=-1))).fit()
    finally:
        t.join()
        s3.start()
    text = str(failed.value)
    assert "storage failed" in text and "OUTLAST_STORAGE_RETRY_S" in text
    assert "EndpointConnectionError" in text or "Connect" in text
