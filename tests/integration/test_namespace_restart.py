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


def _outlast(home, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "outlast.cli.main", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OUTLAST_HOME": str(home), **(env or {})})


def test_status_outside_the_nodes_pid_namespace_says_where_it_runs_and_how_to_ask_it(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    with open(tmp_path / "node.log", "wb") as log:
        node = _start_in_namespace(home, log)
    try:
        wait_until(lambda: _answers(home) or node.poll() is not None, 120, "the agent in its namespace to answer")
        assert node.poll() is None, (tmp_path / "node.log").read_text()
        info = _node_file(home)
        status = _outlast(home, "status")
        assert "no outlast node is running" not in status.stdout + status.stderr
        assert status.returncode == 1
        inside = info["pid_namespace"]
        assert inside.startswith("pid:[") and inside != os.readlink("/proc/self/ns/pid")
        address = info["address"].split("://", 1)[1]
        assert (f"the node box-1 in {home} was started in another pid namespace ({inside}" in status.stderr
                and "run `outlast status` inside it" in status.stderr
                and f"ask it by its address: OUTLAST_ADDRESS={address} outlast status" in status.stderr), status.stderr

        # The way it names answers from here.
        asked = _outlast(home, "status", env={"OUTLAST_ADDRESS": address})
        assert asked.returncode == 0 and "node box-1" in asked.stdout, asked.stdout + asked.stderr

        # `outlast stop` out here signals nothing and leaves the node's file to it.
        stop = _outlast(home, "stop")
        assert stop.returncode == 1 and "run `outlast stop` inside it" in stop.stderr, stop.stderr
        assert _node_file(home) == info and _answers(home)
    finally:
        node.kill()  # unshare --kill-child: the namespace, and the node in it, go with it
        node.wait()
