"""The driver's death, persistent nodes, collectives and bad input, with real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from outlast import train
from outlast.train import RunConfig, ScalingConfig, Trainer, TrainingFailedError
from outlast.errors import NotInWorkerError
from tests.integration.jobs import collective_loop, counting_loop, read_events
from tests.integration.procs import alive, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _as_from_a_terminal() -> None:
    # A driver started from a shell gets SIGINT with its default action and unblocked; do not let
    # this test process's own signal state (inherited across exec) decide that for it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _start_driver(storage_path, events, env=None, log=None):
    out = open(log, "wb") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "tests.integration.driver", storage_path, str(events)],
                            cwd=ROOT, env={**os.environ, **(env or {})}, stdout=out, stderr=out,
                            preexec_fn=_as_from_a_terminal)


def _outlast(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "outlast.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_sigkill_of_the_driver_leaves_no_process_of_the_embedded_node(storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    driver = _start_driver(storage_path, events)
    try:
        wait_until(lambda: len(read_events(events)) == 2, 60, "both workers to start")
        tree = _descendants(driver.pid)
        workers = [e["pid"] for e in read_events(events)]
        assert set(workers) <= set(tree)
        driver.kill()
        driver.wait()
        wait_until(lambda: not any(alive(p) for p in tree), 10, f"agent, fork server and workers {tree} to exit")
    finally:
        driver.kill()
        for pid in _descendants(driver.pid):
            os.kill(pid, signal.SIGKILL)


def test_ctrl_c_in_the_driver_stops_the_workers_and_records_the_run_as_aborted(storage_path, tmp_path):
    events, log = tmp_path / "events.jsonl", tmp_path / "driver.log"
    driver = _start_driver(storage_path, events, log=log)
    try:
        wait_until(lambda: len(read_events(events)) == 2, 60, "both workers to start")
        tree = _descendants(driver.pid)
        driver.send_signal(signal.SIGINT)
        try:
            code = driver.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the driver ignored Ctrl+C; its log:\n{log.read_text()[-3000:]}") from None
        assert code != 0
        assert not any(alive(p) for p in tree)
        state = json.loads((Path(storage_path) / "killed" / "run_state.json").read_text())
        assert state["status"] == "aborted" and state["attempts"][-1]["outcome"] == "aborted"
    finally:
        driver.kill()


def test_sigkill_of_the_driver_makes_a_persistent_node_kill_the_runs_workers(storage_path, tmp_path):
    started = _outlast("start", "--preload", "")
    assert started.returncode == 0, started.stderr
    events = tmp_path / "events.jsonl"
    driver = _start_driver(storage_path, events, env={"OUTLAST_DRIVER_TIMEOUT_S": "2"})
    try:
        wait_until(lambda: len(read_events(events)) == 2, 60, "both workers to start")
        workers = [e["pid"] for e in read_events(events)]
        status = _outlast("status")
        assert all(f"pid {p}" in status.stdout for p in workers), status.stdout
        driver.kill()
        driver.wait()
        wait_until(lambda: not any(alive(p) for p in workers), 15, f"workers {workers} to be killed")
        status = _outlast("status")
        assert status.returncode == 0 and "workers: 0" in status.stdout  # the node itself lives on
    finally:
        driver.kill()
        stopped = _outlast("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert _outlast("status").returncode == 1


def test_fit_uses_a_running_node_instead_of_starting_one(storage_path, tmp_path):
    assert _outlast("start", "--preload", "").returncode == 0
    try:
        node_pid = int(_outlast("status").stdout.split()[3])
        events = str(tmp_path / "events.jsonl")
        result = Trainer(counting_loop, train_loop_config={"events": events, "steps": 6},
                         scaling_config=ScalingConfig(num_workers=2),
                         run_config=RunConfig(name="run", storage_path=storage_path)).fit()
        assert result.last_metrics == {"step": 5}
        import psutil

        fork_server = psutil.Process(node_pid).children()[0].pid
        assert {e["ppid"] for e in read_events(events)} == {fork_server}
        assert "workers: 0" in _outlast("status").stdout
    finally:
        _outlast("stop")


def test_a_second_start_is_refused_while_a_node_runs():
    assert _outlast("start", "--preload", "").returncode == 0
    try:
        again = _outlast("start", "--preload", "")
        assert again.returncode == 1 and "already running" in again.stderr
    finally:
        _outlast("stop")
    assert "no outlast node is running" in _outlast("stop").stderr


def test_broadcast_and_barrier_reach_every_rank(storage_path, tmp_path):
    events = str(tmp_path / "events.jsonl")
    Trainer(collective_loop, train_loop_config={"events": events}, scaling_config=ScalingConfig(num_workers=3),
            run_config=RunConfig(name="c", storage_path=storage_path)).fit()
    got = read_events(events)
    assert sorted(e["rank"] for e in got if e["event"] == "broadcast") == [0, 1, 2]
    assert all(e["value"] == {"from": 0, "seed": 42} for e in got if e["event"] == "broadcast")
    assert len([e for e in got if e["event"] == "barrier"]) == 3


def test_a_barrier_that_a_rank_never_reaches_warns_then_times_out_naming_it(storage_path, tmp_path, monkeypatch,
                                                                           caplog):
    monkeypatch.setenv("OUTLAST_COLLECTIVE_TIMEOUT_S", "1.5")
    monkeypatch.setenv("OUTLAST_COLLECTIVE_WARN_INTERVAL_S", "0.5")
    events = str(tmp_path / "events.jsonl")
    with pytest.raises(TrainingFailedError) as info:
        Trainer(collective_loop, train_loop_config={"events": events, "skip_barrier": [2], "sleep": 5},
                scaling_config=ScalingConfig(num_workers=3),
                run_config=RunConfig(name="c", storage_path=storage_path)).fit()
    root = info.value.root_cause
    assert root.exc_type == "CollectiveTimeoutError"
    assert "barrier #1" in root.message and "ranks [2] never reached it" in root.message
    assert any("barrier #1 has waited" in r.message and "[2]" in r.message for r in caplog.records)


def test_worker_functions_outside_a_worker_say_where_to_call_them():
    with pytest.raises(NotInWorkerError, match="inside the train function"):
        train.report({"x": 1})
    with pytest.raises(NotInWorkerError):
        train.get_context()


def test_a_train_function_that_cannot_be_pickled_is_refused_before_anything_starts(storage_path):
    import threading

    lock = threading.Lock()

    def fn():
        lock.acquire()

    with pytest.raises(TypeError, match="cannot be pickled"):
        Trainer(fn, run_config=RunConfig(name="p", storage_path=storage_path)).fit()


@pytest.mark.parametrize("bad", [
    lambda: ScalingConfig(num_workers=0),
    lambda: ScalingConfig(num_workers="2"),
    lambda: RunConfig(name="a/b"),
    lambda: train.FailureConfig(max_failures=-2),
    lambda: train.CheckpointConfig(checkpoint_score_order="up"),
])
def test_bad_configs_are_refused_with_the_field_named(bad):
    with pytest.raises(ValueError, match=r"(ScalingConfig|RunConfig|FailureConfig|CheckpointConfig)(\.|\(name=)"):
        bad()


def test_isolation_settings_reach_the_node_that_fit_starts(storage_path, tmp_path):
    from outlast.client.discovery import AgentUnavailable
    from outlast.isolation.config import IsolationConfig

    bad = IsolationConfig(enable_resource_isolation=True, cgroup_path=str(tmp_path / "no-such-cgroup"))
    with pytest.raises(AgentUnavailable, match="during start-up"):
        Trainer(counting_loop, train_loop_config={"events": str(tmp_path / "e.jsonl"), "steps": 2},
                run_config=RunConfig(name="iso", storage_path=storage_path), isolation=bad).fit()
