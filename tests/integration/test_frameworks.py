"""Ray Train's framework integrations on outlast: a Lightning, Transformers, XGBoost, LightGBM and JAX run each
survives a killed rank (it resumes from the latest committed checkpoint), a drain (it moves to the
other node from the checkpoint saved on the notice, so no step is lost) and its driver killed with
SIGKILL and started again (it resumes from the last commit). Two nodes on this machine
(`LocalCluster`; a relaunched driver starts its own), real worker processes, gloo or the framework's
own collective; tiny models, few steps."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from outlast.client.preload import TORCH_MODULES
from outlast.storage import open_storage
from outlast.storage.run_store import RunStore
from outlast.testing import LocalCluster
from tests.integration.framework_jobs import make_trainer
from tests.integration.jobs import read_events
from tests.integration.procs import wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster(monkeypatch, tmp_path, request):
    """Two nodes; a test marked `preload(*modules)` has their fork servers import those modules once, so that
    its workers fork warm instead of each importing torch and its framework again (seconds of CPU apiece)."""
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    monkeypatch.setenv("OUTLAST_CAPACITY_TIMEOUT_S", "5")
    marker = request.node.get_closest_marker("preload")
    with LocalCluster(num_nodes=2, node_timeout_s=2, workdir=tmp_path / "cl",
                      preload=list(marker.args) if marker else None) as c:
        yield c


def _drain_at(cluster, events, step: int) -> threading.Thread:
    """Drains the node of the first attempt once its ranks pass `step`."""
    def run():
        wait_until(lambda: any(e["event"] == "step" and e["attempt"] == 1 and e["step"] >= step
                               for e in read_events(events)), 120, f"step {step}")
        node = next(e["node_id"] for e in read_events(events) if e["event"] == "step")
        cluster.drain_node(node, deadline_s=30, message="spot reclaimed")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _starts(events, attempt: int) -> list[dict]:
    return [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == attempt]


def _first_steps(events, attempt: int) -> set[int]:
    steps: dict[int, int] = {}
    for e in read_events(events):
        if e["event"] == "step" and e["attempt"] == attempt:
            steps.setdefault(e["rank"], e["step"])
    return set(steps.values())


def _state(storage_path) -> dict:
    return json.loads((Path(storage_path) / "run" / "run_state.json").read_text())


def _nodes(events, attempt: int) -> set[str]:
    return {e["node_id"] for e in read_events(events) if e["event"] == "step" and e["attempt"] == attempt}


def _check_kill(events, storage_path, committed_step: int) -> None:
    """The run restarted once, and every rank resumed at the step the latest committed checkpoint holds."""
    state = _state(storage_path)
    assert state["status"] == "finished" and len(state["attempts"]) == 2, state
    assert {e["restored_step"] for e in _starts(events, 2)} == {committed_step}
    assert _first_steps(events, 2) == {committed_step}


def _check_drain(events, storage_path) -> int:
    """The run moved to the other node and every rank resumed at the step of the checkpoint it saved on the
    notice (the loop trains on after it until the run is moved; those steps are the ones redone)."""
    state = _state(storage_path)
    assert state["status"] == "finished" and state["failure_counts"] == {"preemption": 1}, state
    assert len(_nodes(events, 1)) == 1 and _nodes(events, 2) and _nodes(events, 1).isdisjoint(_nodes(events, 2))
    jit = [e for e in read_events(events) if e["event"] == "jit"]
    assert sorted(e["rank"] for e in jit) == [0, 1] and {e["attempt"] for e in jit} == {1}
    (saved,) = {e["step"] for e in jit}  # every rank saved on the same step
    assert {e["restored_step"] for e in _starts(events, 2)} == {saved}
    assert _first_steps(events, 2) == {saved}
    return saved


# ---- Lightning -------------------------------------------------------------------------------------------

def _lightning_fit(storage_path, events, **extra):
    pytest.importorskip("lightning")
    return make_trainer("lightning", storage_path, {"events": str(events), "epochs": 3, **extra}).fit()


@pytest.mark.torch
@pytest.mark.preload(*TORCH_MODULES, "lightning.pytorch")
def test_a_lightning_run_resumes_from_its_epoch_checkpoint_after_a_rank_is_killed(cluster, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    # 64 rows, batch 4, two ranks: 8 steps an epoch; rank 1 dies in the second epoch.
    result = _lightning_fit(storage_path, events, kill={"rank": 1, "step": 11})
    _check_kill(events, storage_path, committed_step=8)
    assert result.metrics["epoch"] == 2 and result.metrics["step"] == 24
    with result.checkpoint.as_directory() as d:
        assert (Path(d) / "checkpoint.ckpt").is_file()


@pytest.mark.torch
@pytest.mark.preload(*TORCH_MODULES, "lightning.pytorch")
def test_a_drained_lightning_run_moves_with_its_just_in_time_checkpoint(cluster, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    drainer = _drain_at(cluster, events, 3)
    result = _lightning_fit(storage_path, events, epochs=4, step_sleep=0.15)
    drainer.join()
    restored = _check_drain(events, storage_path)
    assert 3 <= restored < 32 and result.metrics["step"] == 32


# ---- Hugging Face Transformers -----------------------------------------------------------------------------

def _transformers_fit(storage_path, events, tmp_path, **extra):
    pytest.importorskip("transformers")
    config = {"events": str(events), "epochs": 2, "save_steps": 4, "output_dir": str(tmp_path / "hf"), **extra}
    return make_trainer("transformers", storage_path, config).fit()


@pytest.mark.torch
@pytest.mark.preload(*TORCH_MODULES, "transformers")
def test_a_transformers_run_resumes_from_its_last_save_after_a_rank_is_killed(cluster, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    # 64 rows, batch 4 per device, two ranks: 8 steps an epoch, 16 in all; saved every 4 steps.
    result = _transformers_fit(storage_path, events, tmp_path, kill={"rank": 1, "step": 6})
    _check_kill(events, storage_path, committed_step=4)
    with result.checkpoint.as_directory() as d:
        assert json.loads((Path(d) / "checkpoint" / "trainer_state.json").read_text())["global_step"] == 16


@pytest.mark.torch
@pytest.mark.preload(*TORCH_MODULES, "transformers")
def test_a_drained_transformers_run_moves_with_its_just_in_time_checkpoint(cluster, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    drainer = _drain_at(cluster, events, 2)
    result = _transformers_fit(storage_path, events, tmp_path, epochs=3, save_steps=1000, step_sleep=0.15)
    drainer.join()
    restored = _check_drain(events, storage_path)
    assert 2 <= restored < 24
    with result.checkpoint.as_directory() as d:
        assert json.loads((Path(d) / "checkpoint" / "trainer_state.json").read_text())["global_step"] == 24


# ---- XGBoost ------------------------------------------------------------------------------------------------

def _xgboost_fit(storage_path, events, **extra):
    pytest.importorskip("xgboost")
    return make_trainer("xgboost", storage_path, {"events": str(events), "rounds": 12, "frequency": 3, **extra}).fit()


def test_an_xgboost_run_resumes_from_its_latest_checkpoint_after_a_worker_dies(cluster, storage_path, tmp_path):
    from outlast.train.xgboost import RayTrainReportCallback

    events = tmp_path / "events.jsonl"
    result = _xgboost_fit(storage_path, events, kill={"rank": 1, "step": 7})
    _check_kill(events, storage_path, committed_step=6)
    # Both workers train one model in XGBoost's collective, with the run's ranks.
    assert {(e["rank"], e["collective_rank"], e["collective_size"]) for e in _starts(events, 1)} == {(0, 0, 2), (1, 1, 2)}
    assert RayTrainReportCallback.get_model(result.checkpoint).num_boosted_rounds() == 12
    assert "train-rmse" in result.metrics


def test_a_drained_xgboost_run_moves_with_its_just_in_time_checkpoint(cluster, storage_path, tmp_path):
    from outlast.train.xgboost import RayTrainReportCallback

    events = tmp_path / "events.jsonl"
    drainer = _drain_at(cluster, events, 2)
    result = _xgboost_fit(storage_path, events, rounds=30, frequency=100, step_sleep=0.15)
    drainer.join()
    restored = _check_drain(events, storage_path)
    assert 2 <= restored < 30
    assert RayTrainReportCallback.get_model(result.checkpoint).num_boosted_rounds() == 30


# ---- LightGBM ------------------------------------------------------------------------------------------------

def _lightgbm_fit(storage_path, events, **extra):
    pytest.importorskip("lightgbm")
    return make_trainer("lightgbm", storage_path, {"events": str(events), "rounds": 12, "frequency": 3, **extra}).fit()


def test_a_lightgbm_run_resumes_from_its_latest_checkpoint_after_a_worker_dies(cluster, storage_path, tmp_path):
    from outlast.train.lightgbm import RayTrainReportCallback

    events = tmp_path / "events.jsonl"
    result = _lightgbm_fit(storage_path, events, kill={"rank": 1, "step": 7})
    _check_kill(events, storage_path, committed_step=6)
    # Both workers train one model in LightGBM's data-parallel learner: each listens on its own port and
    # knows every other's, in rank order; a new attempt gets new ports.
    for attempt in (1, 2):
        starts = sorted(_starts(events, attempt), key=lambda e: e["rank"])
        machines = starts[0]["machines"].split(",")
        assert [e["num_machines"] for e in starts] == [2, 2] and all(e["machines"] == starts[0]["machines"]
                                                                     for e in starts)
        assert [int(m.rsplit(":", 1)[1]) for m in machines] == [e["local_listen_port"] for e in starts]
    model = RayTrainReportCallback.get_model(result.checkpoint)
    assert model.current_iteration() == 12
    assert "train-l2" in result.metrics


def test_a_drained_lightgbm_run_moves_with_its_just_in_time_checkpoint(cluster, storage_path, tmp_path):
    from outlast.train.lightgbm import RayTrainReportCallback

    events = tmp_path / "events.jsonl"
    drainer = _drain_at(cluster, events, 2)
    result = _lightgbm_fit(storage_path, events, rounds=30, frequency=100, step_sleep=0.15)
    drainer.join()
    restored = _check_drain(events, storage_path)
    assert 2 <= restored < 30
    assert RayTrainReportCallback.get_model(result.checkpoint).current_iteration() == 30


# ---- JAX ------------------------------------------------------------------------------------------------------

def _jax_fit(storage_path, events, monkeypatch, **extra):
    pytest.importorskip("jax")
    return make_trainer("jax", storage_path, {"events": str(events), "steps": 12, "every": 4, **extra}).fit()


def test_a_jax_run_initializes_jax_distributed_and_resumes_after_a_rank_is_killed(
        cluster, storage_path, tmp_path, monkeypatch):
    events = tmp_path / "events.jsonl"
    result = _jax_fit(storage_path, events, monkeypatch, kill={"rank": 1, "step": 6})
    _check_kill(events, storage_path, committed_step=4)
    assert {(e["rank"], e["process_index"], e["process_count"]) for e in _starts(events, 1)} == {(0, 0, 2), (1, 1, 2)}
    assert result.metrics == {"step": 12}


def test_a_drained_jax_run_moves_with_its_just_in_time_checkpoint(cluster, storage_path, tmp_path, monkeypatch):
    events = tmp_path / "events.jsonl"
    drainer = _drain_at(cluster, events, 3)
    result = _jax_fit(storage_path, events, monkeypatch, steps=40, every=1000, step_sleep=0.15)
    drainer.join()
    restored = _check_drain(events, storage_path)
    assert 3 <= restored < 40 and result.last_metrics == {"step": 40}


# ---- a driver killed and started again ------------------------------------------------------------------------

RELAUNCH = {  # each run's train_loop_config: long enough to be killed after a commit, small all the same
    "lightning": {"epochs": 3}, "transformers": {"epochs": 4, "save_steps": 4}, "xgboost": {"rounds": 24, "frequency": 3},
    "lightgbm": {"rounds": 24, "frequency": 3}, "jax": {"steps": 30, "every": 4},
}


def _framework_driver(framework, storage_path, config) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.integration.framework_driver", framework, str(storage_path),
                             json.dumps(config)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _newest_commit(storage_path) -> str | None:
    """The newest checkpoint with a manifest, whether the run state names it yet or not."""
    store = RunStore(open_storage(str(storage_path)), "run")
    manifests = [m for m in (store.read_manifest(d) for d in store.checkpoint_dirs()) if m is not None]
    return max(manifests, key=lambda m: (m.attempt, m.report_index)).checkpoint_dir if manifests else None


def _stepped_past_a_commit(storage_path, events) -> bool:
    try:
        latest = _state(storage_path)["latest_checkpoint"]
    except (FileNotFoundError, ValueError):
        return False
    return latest is not None and sum(e["event"] == "step" for e in read_events(events)) >= 2 * 8


@pytest.mark.parametrize("framework", [pytest.param(f, marks=[pytest.mark.torch] if f in ("lightning", "transformers")
                                                    else []) for f in RELAUNCH])
def test_a_framework_run_whose_driver_is_killed_resumes_from_its_last_commit_when_started_again(
        framework, storage_path, tmp_path):
    pytest.importorskip({"lightning": "lightning", "transformers": "transformers"}.get(framework, framework))
    events = tmp_path / "events.jsonl"
    config = {"events": str(events), "output_dir": str(tmp_path / "hf"), **RELAUNCH[framework]}
    first = _framework_driver(framework, storage_path, {**config, "step_sleep": 0.1})
    try:
        wait_until(lambda: _stepped_past_a_commit(storage_path, events) or first.poll() is not None, 180,
                   "a committed checkpoint and steps past it")
    finally:
        first.kill()
        _, err = first.communicate()
    assert first.returncode == -signal.SIGKILL, err[-3000:]
    committed = _newest_commit(storage_path)
    second = _framework_driver(framework, storage_path, config)
    _, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-3000:]
    state = _state(storage_path)
    assert [a["outcome"] for a in state["attempts"]] == ["driver_lost", "finished"], state
    assert state["failure_counts"] == {"driver": 1} and state["attempts"][1]["restored_from"] == committed
    (restored,) = {e["restored_step"] for e in _starts(events, 2)}
    assert restored is not None and restored > 0 and _first_steps(events, 2) == {restored}
