"""`LocalCluster`: several node agents on this machine, each a separate node of one cluster.

They speak the same protocol as agents on separate machines (a head with its node table,
members that join it, the cluster key), so tests and benchmarks exercise what a real
cluster does: placement across nodes, a node killed or drained, a restart on another.

    with LocalCluster(num_nodes=3) as cluster:
        Trainer(...).fit()           # uses the cluster: OUTLAST_ADDRESS points at its head
        cluster.drain_node("node-1", deadline_s=20)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from outlast.client.discovery import AgentUnavailable, request, start_agent_process
from outlast.client.preload import default_preload
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.storage.tier_store import default_root as default_tier_root


@dataclass
class LocalNode:
    node_id: str
    address: str
    proc: subprocess.Popen
    log_path: Path
    args: list[str]


class LocalCluster:
    def __init__(self, num_nodes: int = 2, *, preload: list[str] | None = None, cpus_per_node: float | None = None,
                 failure_domains: list[str] | None = None, node_timeout_s: float = 3.0,
                 workdir: str | os.PathLike[str] | None = None, etcd: str | None = None,
                 etcd_lease_ttl_s: int = 2, node_args: list[str] | None = None) -> None:
        """`failure_domains[i]`: the failure domain of node i ("" for none). `preload`: modules every
        node's fork server imports, so that workers start warm (default: the same as `outlast start`'s,
        `outlast.client.preload.default_preload()`). `etcd`: the client URLs of an etcd cluster that keeps
        the cluster's state (no head process; the head role is elected). `node_args`: more arguments of
        every node's `outlast start` (e.g. `--checkpoint-memory 8MiB`)."""
        self.node_args = list(node_args or [])
        self.etcd = etcd
        self.etcd_lease_ttl_s = etcd_lease_ttl_s
        if num_nodes < 1:
            raise ValueError(f"LocalCluster needs at least one node, got num_nodes={num_nodes}")
        self.preload = default_preload() if preload is None else list(preload)
        self.cpus_per_node = cpus_per_node
        self.node_timeout_s = node_timeout_s
        self._domains = list(failure_domains or [])
        self._tmp = tempfile.TemporaryDirectory(prefix="outlast-cluster-") if workdir is None else None
        self.workdir = Path(workdir or self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.key_file = self.workdir / "cluster.key"
        # The nodes' memory tiers: RAM as on machines, apart from other clusters' nodes of the same names.
        tiers = default_tier_root()
        tiers.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.tier_dir = Path(tempfile.mkdtemp(prefix="cluster-", dir=tiers))
        self.nodes: dict[str, LocalNode] = {}
        self._saved_env: dict[str, str | None] = {}
        self._ctx = zmq.Context()
        try:
            for _ in range(num_nodes):
                self.add_node()
        except BaseException:
            self.shutdown()
            raise

    # ---- nodes ----------------------------------------------------------------------------

    @property
    def head_address(self) -> str:
        """The head's address; with etcd, the first node still running (any agent answers for the cluster)."""
        if self.etcd:
            return next((n.address for n in self.nodes.values() if n.proc.poll() is None),
                        next(iter(self.nodes.values())).address)
        return next(iter(self.nodes.values())).address

    @property
    def node_ids(self) -> list[str]:
        return list(self.nodes)

    def add_node(self, node_id: str | None = None, failure_domain: str | None = None,
                 extra_args: list[str] | None = None) -> str:
        """Start one more node (the first is the head) and return its id once it has joined."""
        i = len(self.nodes)
        node_id = node_id or f"node-{i}"
        domain = failure_domain if failure_domain is not None else (self._domains[i] if i < len(self._domains) else "")
        args = ["--node-id", node_id, "--cluster-key", str(self.key_file), "--die-with-parent",
                "--node-timeout", str(self.node_timeout_s)]
        if self.etcd:
            args += ["--etcd", self.etcd]
        elif self.nodes:
            args += ["--address", self.head_address]
        if self.cpus_per_node is not None:
            args += ["--num-cpus", str(self.cpus_per_node)]
        if domain:
            args += ["--failure-domain", domain]
        self._start(node_id, args + self.node_args + (extra_args or []))
        return node_id

    def restart_node(self, node_id: str) -> str:
        """Start a node's agent again after it died (as its supervisor would): same id, same
        arguments, same state directory; it cleans what its predecessor left and rejoins.
        Returns its (new) address."""
        node = self.nodes[node_id]
        if node.proc.poll() is None:
            raise ValueError(f"node {node_id}'s agent (pid {node.proc.pid}) still runs; kill_node() it first")
        # On its old port, as a supervisor restarts a node with a fixed address: drivers, members and
        # the head keep their addresses for it.
        port = node.address.rsplit(":", 1)[1]
        args = [a for i, a in enumerate(node.args) if a != "--port" and (i == 0 or node.args[i - 1] != "--port")]
        return self._start(node_id, args + ["--port", port]).address

    def _start(self, node_id: str, args: list[str]) -> LocalNode:
        log_path = self.workdir / f"{node_id}.log"
        # Each node keeps its own state (checkpoint cache, node file) as a machine would.
        env = {"OUTLAST_HOME": str(self.workdir / node_id), "OUTLAST_ETCD_LEASE_TTL_S": str(self.etcd_lease_ttl_s),
               "OUTLAST_TIER_DIR": str(self.tier_dir)}
        proc, address = start_agent_process(self.preload, embedded=False, extra_args=args, log_path=log_path, env=env)
        node = self.nodes[node_id] = LocalNode(node_id, address, proc, log_path, args)
        return node

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Until every node's fork server has its modules imported."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes.values():
            while True:
                reply = self._request(node.address, m.StatusRequest())
                if isinstance(reply, m.StatusReply) and reply.zygote_ready:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {node.node_id}'s fork server not ready within {timeout_s:.0f} s")
                time.sleep(0.05)

    def kill_node(self, node_id: str) -> None:
        """SIGKILL the node's agent, as a lost machine: its fork server and workers die with it."""
        node = self.nodes[node_id]
        node.proc.kill()
        node.proc.wait()

    def stop_node(self, node_id: str, sig: int = signal.SIGTERM) -> None:
        """Signal the node's agent (SIGTERM drains it first, as on a machine being shut down)."""
        self.nodes[node_id].proc.send_signal(sig)

    def drain_node(self, node_id: str, deadline_s: float | None = None, reason: str = "preemption",
                   message: str = "") -> m.DrainAck:
        """What `outlast drain-node` does: the head marks the node (and its failure domain) as draining."""
        reply = self._request(self.head_address, m.DrainNode(node_id=node_id, reason=reason, message=message,
                                                             deadline_remaining_s=deadline_s))
        if isinstance(reply, m.DrainRefused):
            raise ValueError(reply.reason)
        assert isinstance(reply, m.DrainAck)
        return reply

    def node_table(self) -> list[m.NodeInfo]:
        reply = self._request(self.head_address, m.ListNodes())
        assert isinstance(reply, m.NodeList)
        return reply.nodes

    def _request(self, address: str, msg: m.Msg) -> m.AgentEvent:
        return request(self._ctx, address, msg, timeout_s=5.0, key=ClusterKey.load(self.key_file))

    # ---- as the cluster drivers use ----------------------------------------------------------

    def __enter__(self) -> "LocalCluster":
        self._set_env({"OUTLAST_ADDRESS": self.head_address, "OUTLAST_CLUSTER_KEY": str(self.key_file)})
        if self.etcd:  # drivers read the table and drains from etcd themselves
            self._set_env({"OUTLAST_ETCD": self.etcd, "OUTLAST_ETCD_LEASE_TTL_S": str(self.etcd_lease_ttl_s)})
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _set_env(self, values: dict[str, str]) -> None:
        for k, v in values.items():
            self._saved_env.setdefault(k, os.environ.get(k))
            os.environ[k] = v

    def shutdown(self) -> None:
        for node in reversed(list(self.nodes.values())):
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGINT)  # stop at once, without a drain
        for node in self.nodes.values():
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved_env.clear()
        self._ctx.term()
        shutil.rmtree(self.tier_dir, ignore_errors=True)
        if self._tmp is not None:
            self._tmp.cleanup()


__all__ = ["AgentUnavailable", "LocalCluster", "LocalNode"]
