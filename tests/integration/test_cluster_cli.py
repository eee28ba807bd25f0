"""`outlast start --address`, `outlast status` and `outlast drain-node` on a cluster of real agents.

Each "machine" is its own OUTLAST_HOME (its node file, its copy of the cluster key), as on
separate hosts; the agents talk over loopback with the cluster key.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from outlast.testing import LocalCluster

ROOT = Path(__file__).resolve().parents[2]


class Machines:
    """Runs the CLI as if on separate machines, and stops every node started that way."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.homes: list[Path] = []

    def home(self, name: str) -> Path:
        home = self.root / name
        if home not in self.homes:
            self.homes.append(home)
        return home

    def env(self, machine: str) -> dict[str, str]:
        """This process's environment, less what points at another cluster, with the machine's home."""
        base = {k: v for k, v in os.environ.items()
                if k not in ("OUTLAST_ADDRESS", "OUTLAST_CLUSTER_KEY", "OUTLAST_CLUSTER_SECRET")}
        return {**base, "OUTLAST_HOME": str(self.home(machine))}

    def outlast(self, machine: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "outlast.cli.main", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=90, env=self.env(machine))

    def start(self, machine: str, *args: str) -> subprocess.CompletedProcess:
        started = self.outlast(machine, "start", "--preload", "", "--node-id", machine, *args)
        assert started.returncode == 0, started.stdout + started.stderr
        return started

    def stop_all(self) -> None:
        stops = [subprocess.Popen([sys.executable, "-m", "outlast.cli.main", "stop", "--timeout", "5"], cwd=ROOT,
                                  env=self.env(home.name),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for home in self.homes if (home / "node.json").exists()]
        for stop in stops:
            stop.wait(timeout=60)


@pytest.fixture
def machines(tmp_path):
    ms = Machines(tmp_path / "machines")
    yield ms
    ms.stop_all()


def _join_command(head_output: str) -> list[str]:
    """The `outlast start --address ... --cluster-key ...` line a head prints, as arguments."""
    line = next(line for line in head_output.splitlines() if line.strip().startswith("outlast start --address"))
    return shlex.split(line)[1:]  # without "outlast"


def test_a_head_prints_how_to_join_it_and_a_member_joined_that_way_shows_in_both_statuses(machines):
    head = machines.start("head")
    key_file = machines.home("head") / "cluster.key"
    assert f"its key: {key_file}" in head.stdout
    join = _join_command(head.stdout)
    assert join[:2] == ["start", "--address"] and join[3:] == ["--cluster-key", str(key_file)]
    assert "only this machine can join it" in head.stdout and "--host 0.0.0.0" in head.stdout
    head_address = "tcp://" + join[2]

    member = machines.outlast("member-1", *join, "--preload", "", "--node-id", "member-1",
                              "--labels", "zone=b", "--resources", "TPU=4")
    assert member.returncode == 0, member.stdout + member.stderr
    assert f"joined the cluster whose head is at {head_address}" in member.stdout

    on_head = machines.outlast("head", "status")
    assert on_head.returncode == 0, on_head.stderr
    assert "this node is its head; 2 node(s): 2 alive\n" in on_head.stdout
    rows = {line.split()[0]: line for line in on_head.stdout.splitlines() if line.startswith("  ")}
    assert "alive" in rows["head"] and "(head)" in rows["head"]
    assert "alive" in rows["member-1"] and "zone=b" in rows["member-1"] and "TPU 4" in rows["member-1"]

    # The member found the key where the CLI looks for it, and shows the head's table.
    on_member = machines.outlast("member-1", "status")
    assert on_member.returncode == 0, on_member.stderr
    assert f"this node is a member; its head is at {head_address}" in on_member.stdout
    assert re.search(r"^  member-1 \*\s+alive", on_member.stdout, re.M), on_member.stdout
    assert re.search(r"^  head \(head\)\s+alive", on_member.stdout, re.M), on_member.stdout


def test_drain_node_of_an_unknown_id_fails_and_names_the_known_nodes(machines):
    join = _join_command(machines.start("head").stdout)
    assert machines.outlast("member-1", *join, "--preload", "", "--node-id", "member-1").returncode == 0

    refused = machines.outlast("member-1", "drain-node", "--node-id", "no-such-node")
    assert refused.returncode == 1
    assert "no node 'no-such-node' in this cluster" in refused.stderr
    assert "its nodes are: head, member-1" in refused.stderr
    assert "draining" not in machines.outlast("head", "status").stdout


def test_a_drain_sent_through_a_member_reaches_the_head_and_takes_the_failure_domain(tmp_path):
    with LocalCluster(num_nodes=4, failure_domains=["", "rack-a", "rack-a", "rack-b"]) as cluster:
        member = cluster.nodes["node-1"].address
        env = {**os.environ, "OUTLAST_ADDRESS": member, "OUTLAST_HOME": str(tmp_path / "driver")}
        done = subprocess.run([sys.executable, "-m", "outlast.cli.main", "drain-node", "--node-id", "node-1",
                               "--reason", "maintenance", "--reason-message", "rack a power work",
                               "--deadline-remaining-seconds", "60"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        assert "drained: node-1, node-2" in done.stdout

        states = {n.node_id: n.state for n in cluster.node_table()}
        assert states == {"node-0": "alive", "node-1": "draining", "node-2": "draining", "node-3": "alive"}

        env["OUTLAST_ADDRESS"] = cluster.head_address  # straight at the head
        status = subprocess.run([sys.executable, "-m", "outlast.cli.main", "status"], cwd=ROOT,
                                capture_output=True, text=True, timeout=60, env=env)
        assert status.returncode == 0, status.stderr
        assert "4 node(s): 2 alive, 2 draining\n" in status.stdout
        assert "draining: maintenance (rack a power work), deadline in" in status.stdout
        assert "the drain of node-1 took its failure domain: node-1, node-2" in status.stdout
