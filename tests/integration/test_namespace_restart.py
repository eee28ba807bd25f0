"""A node whose container crashed starts again: `outlast start --block` in a pid namespace of its
own, killed -9 with the namespace, then started in a new namespace on the same OUTLAST_HOME."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import zmq

from outlast.client.discovery import request
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from tests.integration.procs import wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="a pid namespace of its own needs root and unshare(1)")


def _start_in_namespace(home, log):
    return subprocess.Popen(
        # --kill-child: killing unshare kills the namespace's init, and the kernel then every process in it.
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-m", "outlast.cli.main",
         "start", "--block", "--node-id", "box-1", "--preload", ""],
        env={**os.environ, "OUTLAST_HOME": str(home)}, stdout=log, stderr=subprocess.STDOUT)


def _node_file(home):
    try:
        return json.loads((home / "node.json").read_text())
    except (OSError, ValueError):
        return None


def _answers(home) -> bool:
    info = _node_file(home)
    if info is None:
        return False
    ctx = zmq.Context()
    try:
        return isinstance(request(ctx, info["address"], m.Ping(), timeout_s=2.0,
                                  key=ClusterKey.load(home / "cluster.key")), m.Pong)
    except Exception:
        return False
    finally:
        ctx.term()


def test_a_node_killed_with_its_pid_namespace_starts_again_in_a_new_one(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    with open(tmp_path / "first.log", "wb") as log:
        first = _start_in_namespace(home, log)
    try:
        wait_until(lambda: _answers(home), 120, "the first agent to answer")
        owner = json.loads((home / "agents" / "box-1" / "owner.json").read_text())
        first.kill()  # the namespace goes with everything in it: the agent leaves its files behind
        first.wait()
        assert (home / "agents" / "box-1" / "owner.json").exists()
        (home / "node.json").unlink()  # so that the wait below sees the second agent's
        with open(tmp_path / "second.log", "wb") as log:
            second = _start_in_namespace(home, log)
        try:
            wait_until(lambda: _answers(home) or second.poll() is not None, 120, "the second agent to answer")
            assert second.poll() is None, (tmp_path / "second.log").read_text()
            again = json.loads((home / "agents" / "box-1" / "owner.json").read_text())
            assert again["host_id"] != owner["host_id"]  # another pid namespace, as a restarted container's
            assert "removed" in (tmp_path / "second.log").read_text()
        finally:
            second.kill()
            second.wait()
    finally:
        first.kill()
        first.wait()
