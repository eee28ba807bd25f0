"""A node file as a host leaves it: its agent died by SIGKILL (its pid may be anyone's now), or it runs
and is slow to answer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq

from outlast.client import discovery
from outlast.client.discovery import AgentUnavailable, NodeFile, attach, find_running_agent
from outlast.identity import ProcessIdentity, identify
from tests.integration.procs import alive

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "1000"])
    yield proc
    proc.kill()
    proc.wait()


def _publish(home: Path, pid: int, process: ProcessIdentity | None, node_id: str = "slow") -> None:
    """A node file as `outlast start` leaves it, at an address where nothing answers."""
    home.mkdir(mode=0o700, exist_ok=True)
    (home / "node.json").write_bytes(msgspec.json.encode(
        NodeFile(address="tcp://127.0.0.1:9", pid=pid, node_id=node_id, process=process)))


def stop(home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUTLAST_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "outlast.cli.main", "stop", "--timeout", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("recorded", ["agent-that-died", "nothing"])
def test_stop_leaves_alone_an_unrelated_process_that_has_the_dead_agents_pid(tmp_path, sleeper, recorded):
    home = tmp_path / "home"
    now = identify(sleeper.pid)
    # What the dead agent recorded: its own start time and command line, at the same pid.
    process = (ProcessIdentity(pid=sleeper.pid, started_at=now.started_at - 60,
                               cmdline=[sys.executable, "-m", "outlast.agent"])
               if recorded == "agent-that-died" else None)
    _publish(home, sleeper.pid, process, node_id="gone")
    result = stop(home)
    assert result.returncode == 1
    assert "was stale" in result.stderr and "signalled nothing" in result.stderr
    assert alive(sleeper.pid) and sleeper.poll() is None
    assert not (home / "node.json").exists()


def test_a_node_that_runs_and_does_not_answer_is_waited_for_and_never_replaced(tmp_path, sleeper, monkeypatch):
    """A starved node answers late. Were its silence taken for no node, a driver would start an embedded
    node in its place, without the isolation `outlast start` was given, and the kernel would kill for memory."""
    home = tmp_path / "home"
    _publish(home, sleeper.pid, identify(sleeper.pid))  # the process that published it still runs
    monkeypatch.setenv("OUTLAST_HOME", str(home))
    monkeypatch.delenv("OUTLAST_ADDRESS", raising=False)
    monkeypatch.setattr(discovery, "NODE_ANSWER_S", 1.0)
    before = {p.pid for p in psutil.Process().children()}  # the session's own (a guest kernel's run)
    ctx = zmq.Context()
    try:
        with pytest.raises(AgentUnavailable) as e:
            attach(ctx, preload=[])
    finally:
        ctx.term()
    assert f"(pid {sleeper.pid}) runs but did not answer" in str(e.value) and "outlast stop" in str(e.value)
    started = {p.pid for p in psutil.Process().children()} - before
    assert not started, f"a node was started: {started}"
    assert (home / "node.json").exists() and alive(sleeper.pid)


def test_a_node_file_whose_pid_is_another_process_now_is_no_node(tmp_path, sleeper, monkeypatch):
    home = tmp_path / "home"
    now = identify(sleeper.pid)
    _publish(home, sleeper.pid, ProcessIdentity(pid=sleeper.pid, started_at=now.started_at - 60,
                                                cmdline=[sys.executable, "-m", "outlast.agent"]))
    monkeypatch.setenv("OUTLAST_HOME", str(home))
    monkeypatch.delenv("OUTLAST_ADDRESS", raising=False)
    ctx = zmq.Context()
    try:
        assert find_running_agent(ctx) is None  # at once: nothing to wait for
    finally:
        ctx.term()
