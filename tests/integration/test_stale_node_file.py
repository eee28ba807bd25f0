"""`outlast stop` with a node file whose agent died by SIGKILL: its pid may be anyone's now."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from outlast.client.discovery import NodeFile
from outlast.identity import ProcessIdentity, identify
from tests.integration.procs import alive

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "1000"])
    yield proc
    proc.kill()
    proc.wait()


def stop(home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUTLAST_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "outlast.cli.main", "stop", "--timeout", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("recorded", ["agent-that-died", "nothing"])
def test_stop_leaves_alone_an_unrelated_process_that_has_the_dead_agents_pid(tmp_path, sleeper, recorded):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    now = identify(sleeper.pid)
    # What the dead agent recorded: its own start time and command line, at the same pid.
    process = (ProcessIdentity(pid=sleeper.pid, started_at=now.started_at - 60,
                               cmdline=[sys.executable, "-m", "outlast.agent"])
               if recorded == "agent-that-died" else None)
    (home / "node.json").write_bytes(msgspec.json.encode(
        NodeFile(address="tcp://127.0.0.1:9", pid=sleeper.pid, node_id="gone", process=process)))
    result = stop(home)
    assert result.returncode == 1
    assert "was stale" in result.stderr and "signalled nothing" in result.stderr
    assert alive(sleeper.pid) and sleeper.poll() is None
    assert not (home / "node.json").exists()
