"""A run written by a newer outlast is refused as it is, through fit() and `outlast runs`: its run state is
not set aside, its history not rebuilt, its checkpoints not forgotten."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from outlast.storage.records import MANIFEST_VERSION, RUN_STATE_VERSION
from outlast.train import FailureConfig, NewerVersionError, RunConfig, ScalingConfig, Trainer
from tests.integration.jobs import counting_loop, read_events

ROOT = Path(__file__).resolve().parents[2]
LEASE = "driver_lease.json"  # the relaunch's lease comes and goes; nothing else may change


def _fit(storage_path, events, steps=12):
    return Trainer(counting_loop, train_loop_config={"events": str(events), "steps": steps, "every": 5},
                   scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name="run", storage_path=str(storage_path),
                                        failure_config=FailureConfig(max_failures=0))).fit()


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != LEASE}


def _as_newer(path: Path, unfinished: bool = False) -> None:
    doc = json.loads(path.read_text())
    doc["version"] += 1
    doc["a_field_of_the_newer_version"] = {"kept": True}
    if unfinished:
        doc["status"] = "running"
    path.write_text(json.dumps(doc, indent=2))


@pytest.fixture
def written_run(storage_path, tmp_path):
    """A run of 12 steps with checkpoints at steps 4 and 9, its history marked unfinished."""
    _fit(storage_path, tmp_path / "first.jsonl")
    run = Path(storage_path) / "run"
    state = json.loads((run / "run_state.json").read_text())
    assert state["latest_checkpoint"] and len(state["checkpoints"]) == 2
    return run


def _refused(storage_path, tmp_path, run: Path, newer: str, ours: int = RUN_STATE_VERSION) -> None:
    before = _files(run)
    events = tmp_path / "second.jsonl"
    with pytest.raises(NewerVersionError) as caught:
        _fit(storage_path, events, steps=20)
    text = str(caught.value)
    assert f"{newer} has schema version {ours + 1}, written by a newer outlast" in text
    assert f"reads versions up to {ours}" in text and "upgrade outlast" in text
    assert _files(run) == before, "the refused run's directory was changed"
    started = [e for e in read_events(events) if e["event"] == "start"] if events.exists() else []
    assert started == [], "the refused run trained"


def test_a_run_state_of_a_newer_version_refuses_fit_and_nothing_is_moved(storage_path, tmp_path, written_run):
    _as_newer(written_run / "run_state.json", unfinished=True)
    _refused(storage_path, tmp_path, written_run, "run_state.json")
    assert not list(written_run.glob("run_state.json.corrupt-*"))


def test_newer_run_state_and_manifests_refuse_fit_instead_of_starting_over(storage_path, tmp_path, written_run):
    _as_newer(written_run / "run_state.json", unfinished=True)
    for manifest in written_run.glob("checkpoint_*/.outlast-manifest.json"):
        _as_newer(manifest)
    _refused(storage_path, tmp_path, written_run, "run_state.json")


def test_a_newer_manifest_of_the_latest_checkpoint_refuses_fit(storage_path, tmp_path, written_run):
    state = json.loads((written_run / "run_state.json").read_text())
    state["status"] = "running"
    (written_run / "run_state.json").write_text(json.dumps(state, indent=2))
    _as_newer(written_run / state["latest_checkpoint"] / ".outlast-manifest.json")
    _refused(storage_path, tmp_path, written_run, f"{state['latest_checkpoint']}/.outlast-manifest.json",
             ours=MANIFEST_VERSION)


def test_a_newer_manifest_without_a_run_state_is_refused_not_ignored(storage_path, tmp_path, written_run):
    (written_run / "run_state.json").unlink()
    for manifest in written_run.glob("checkpoint_*/.outlast-manifest.json"):
        _as_newer(manifest)
    _refused(storage_path, tmp_path, written_run, ".outlast-manifest.json", ours=MANIFEST_VERSION)


def test_outlast_runs_names_both_versions_of_a_newer_run(storage_path, written_run):
    _as_newer(written_run / "run_state.json")
    before = _files(written_run)
    cli = [sys.executable, "-m", "outlast.cli.main", "runs", str(storage_path)]
    listed = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert f"schema version {RUN_STATE_VERSION + 1}, written by a newer outlast" in listed.stdout
    assert f"reads versions up to {RUN_STATE_VERSION}" in listed.stdout
    shown = subprocess.run([*cli, "run"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 1
    assert f"schema version {RUN_STATE_VERSION + 1}, written by a newer outlast" in shown.stderr and "Traceback" not in shown.stderr
    assert _files(written_run) == before
