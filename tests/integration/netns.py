"""Outlast nodes in Linux network namespaces, so that a test can cut one node off the network.

    root namespace                      ol-<pid>-<tok>-1          ol-<pid>-<tok>-2   ...
      driver (the test process)           agent n1 (10.77.X.11)     agent n2 (10.77.X.12)
      head agent (10.77.X.1)                  |                         |
      bridge olbr<tok> 10.77.X.1/24 --- ol<tok>h1 <-veth-> ol<tok>n1     ol<tok>h2 <-veth-> ...

The head listens on the bridge's address in the root namespace, where the driver also runs;
each member agent runs inside its own namespace (`ip netns exec`), listens on its own address
and joins the head. `cut(node_id)` takes the root-side end of the node's veth down: the node
hears neither the head nor the driver any more, and they do not hear it, while its processes
go on running, as on a machine whose network failed.

Everything created (namespaces, bridge, veths, processes) is undone by `shutdown()`, even
after a failure halfway through set-up. Namespaces carry the creating pid in their name, so a
later run sweeps what a killed test process left behind. Needs root and iproute2's `ip`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from outlast.procutil import pid_alive
from tests.integration.jobs import counting_loop, log_event

PREFIX = "ol-"  # namespace names: ol-<pid>-<tok>-<i>
_LOCK = "/run/outlast-netns.lock"


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespace tests need root (ip netns, veth, bridge)"
    if shutil.which("ip") is None:
        return "network namespace tests need iproute2's `ip` command"
    return None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netns_inode(name: str | None = None) -> int:
    """The inode of a named namespace (None: this process's), which /proc/PID/ns/net shows too."""
    return os.stat(f"/run/netns/{name}" if name else "/proc/self/ns/net").st_ino


def namespace_pids(name: str) -> list[int]:
    out = ip("netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def sweep_stale() -> None:
    """Remove the namespaces and bridges of earlier test processes that died without cleaning up."""
    for name in ip("netns", "list", check=False).stdout.split():
        match = re.fullmatch(rf"{PREFIX}(\d+)-([0-9a-f]+)-\d+", name)
        if not match or pid_alive(int(match.group(1))):
            continue
        _kill_pids(namespace_pids(name))  # what our agents left in there
        ip("netns", "del", name, check=False)
        ip("link", "del", f"olbr{match.group(2)}", check=False)



def _used_subnets() -> set[str]:
    text = ip("-4", "-o", "addr", "show", check=False).stdout + ip("-4", "route", "show", "table", "all",
                                                                      check=False).stdout
    return set(re.findall(r"\b10\.77\.(\d+)\.", text))


@dataclass
class NetnsNode:
    node_id: str
    ip: str
    address: str  # tcp://IP:PORT
    proc: subprocess.Popen
    log_path: Path
    netns: str | None  # None: the root namespace (the head)
    host_veth: str | None = None  # the root-side end of its link

    @property
    def netns_inode(self) -> int:
        return netns_inode(self.netns)


@dataclass
class NetnsCluster:
    """A head in the root namespace and `num_members` member agents, one per namespace."""

    num_members: int = 3
    node_timeout_s: float = 2.0
    workdir: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    start_timeout_s: float = 60.0
    launcher: Callable[[], None] | None = None  # run in each agent's process before it execs (e.g. enter a cgroup)
    # `ip netns exec` mounts a sysfs of the namespace's own over /sys, which hides /sys/fs/cgroup;
    # nsenter enters the network namespace alone, so that an agent there can use cgroups.
    keep_mounts: bool = False

    def __post_init__(self) -> None:
        self.token = secrets.token_hex(2)
        self.bridge = f"olbr{self.token}"
        self.nodes: dict[str, NetnsNode] = {}
        self._undo: list[list[str]] = []  # `ip` commands, run in reverse by shutdown()
        self._namespaces: list[str] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="outlast-netns-") if self.workdir is None else None
        self.workdir = Path(self.workdir or self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.key_file = self.workdir / "cluster.key"
        try:
            sweep_stale()
            self._make_network()
            self._start_agents()
        except BaseException:
            self.shutdown()
            raise

    # ---- the network ------------------------------------------------------------------------

    def _make_network(self) -> None:
        with open(_LOCK, "w") as lock:  # two test runs must not pick the same subnet
            fcntl.flock(lock, fcntl.LOCK_EX)
            free = [x for x in range(256) if str(x) not in _used_subnets()]
            if not free:
                raise RuntimeError("no free 10.77.X.0/24 subnet for the test network")
            x = free[secrets.randbelow(len(free))]
            self.subnet = f"10.77.{x}"
            self.bridge_ip = f"{self.subnet}.1"
            ip("link", "add", self.bridge, "type", "bridge")
            self._undo.append(["link", "del", self.bridge])
            ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i in range(1, self.num_members + 1):
            ns = f"{PREFIX}{os.getpid()}-{self.token}-{i}"
            host_end, ns_end = f"ol{self.token}h{i}", f"ol{self.token}n{i}"
            ip("netns", "add", ns)
            self._namespaces.append(ns)
            self._undo.append(["netns", "del", ns])  # deleting it destroys the veth pair too
            ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            self._undo.append(["link", "del", host_end])
            ip("link", "set", ns_end, "netns", ns)
            ip("link", "set", host_end, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{self.subnet}.{10 + i}/24", "dev", ns_end)
            ip("-n", ns, "link", "set", ns_end, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def cut(self, node_id: str) -> None:
        """Disconnect the node: its link to the bridge goes down, its processes keep running."""
        ip("link", "set", self._veth(node_id), "down")

    def heal(self, node_id: str) -> None:
        ip("link", "set", self._veth(node_id), "up")

    def _veth(self, node_id: str) -> str:
        veth = self.nodes[node_id].host_veth
        if veth is None:
            raise ValueError(f"{node_id} runs in the root namespace; it has no link to cut")
        return veth

    # ---- the agents -------------------------------------------------------------------------

    @property
    def head_address(self) -> str:
        return self.nodes["head"].address

    @property
    def env(self) -> dict[str, str]:
        """What a driver in the root namespace needs to use this cluster."""
        return {"OUTLAST_ADDRESS": self.head_address, "OUTLAST_CLUSTER_KEY": str(self.key_file)}

    def _start_agents(self) -> None:
        self._start("head", self.bridge_ip, None, None)
        for i, ns in enumerate(self._namespaces, start=1):
            self._start(f"n{i}", f"{self.subnet}.{10 + i}", ns, f"ol{self.token}h{i}")

    def _start(self, node_id: str, node_ip: str, netns: str | None, host_veth: str | None) -> None:
        args = ["--node-id", node_id, "--host", node_ip, "--node-ip", node_ip, "--port", "0",
                "--cluster-key", str(self.key_file), "--node-timeout", str(self.node_timeout_s),
                "--die-with-parent", "--preload", "", *self.extra_args]
        if self.nodes:
            args += ["--address", self.head_address]
        log_path = self.workdir / f"{node_id}.log"
        # Each node keeps its own state (node file, checkpoint cache, memory tier), as a machine would, so
        # two clusters on one host with the same node ids never share a tier.
        env = {**os.environ, "OUTLAST_HOME": str(self.workdir / node_id),
               "OUTLAST_TIER_DIR": str(self.workdir / "tier")}
        env.pop("OUTLAST_ADDRESS", None)
        r, w = os.pipe()
        # Either execs in place: the pid is the agent's.
        prefix = ([] if not netns else ["nsenter", f"--net=/run/netns/{netns}", "--"] if self.keep_mounts
                  else ["ip", "netns", "exec", netns])
        cmd = [*prefix, sys.executable, "-m", "outlast.agent", "--ready-fd", str(w), *args]
        with open(log_path, "ab") as out:
            try:
                proc = subprocess.Popen(cmd, pass_fds=[w], start_new_session=True, stdout=out, stderr=out,
                                        stdin=subprocess.DEVNULL, env=env, preexec_fn=self.launcher)
            finally:
                os.close(w)
        # Registered before it is known to work, so that shutdown() stops it whatever happens.
        node = NetnsNode(node_id, node_ip, "", proc, log_path, netns, host_veth)
        self.nodes[node_id] = node
        try:
            node.address = _read_line(r, proc, self.start_timeout_s, log_path)
        finally:
            os.close(r)
        if not node.address.startswith(f"tcp://{node_ip}:"):
            raise RuntimeError(f"{node_id} listens at {node.address}, not on {node_ip}; see {log_path}")

    def wait_joined(self, timeout_s: float = 30.0) -> None:
        """Until the head lists every node alive."""
        want = set(self.nodes)
        deadline = time.monotonic() + timeout_s
        while True:
            alive = {n.node_id for n in self.node_table() if n.state == "alive"}
            if want <= alive:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes {sorted(want - alive)} did not join the head within {timeout_s} s")
            time.sleep(0.1)

    def node_table(self, timeout_s: float = 2.0):
        """The head's node table (a ListNodes request), as a list of NodeInfo."""
        import zmq

        from outlast.client.discovery import request
        from outlast.protocol import messages as m
        from outlast.protocol.auth import ClusterKey

        ctx = zmq.Context()
        try:
            reply = request(ctx, self.head_address, m.ListNodes(), timeout_s=timeout_s,
                            key=ClusterKey.load(self.key_file))
        finally:
            ctx.term()
        if not isinstance(reply, m.NodeList):
            raise RuntimeError(f"the head answered ListNodes with {reply!r}")
        return reply.nodes

    def node_of_netns(self) -> dict[int, str]:
        """Network namespace inode -> node id (the head's is the root namespace's)."""
        return {node.netns_inode: node.node_id for node in self.nodes.values()}

    def leftover_pids(self) -> dict[str, list[int]]:
        """Processes still running in the members' namespaces."""
        return {ns: pids for ns in self._namespaces if (pids := namespace_pids(ns))}

    def log_tail(self, node_id: str, lines: int = 40) -> str:
        try:
            text = self.nodes[node_id].log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # ---- teardown -----------------------------------------------------------------------------

    def stop_agents(self, timeout_s: float = 30.0) -> None:
        """SIGINT every agent (stop at once, no drain); SIGKILL what is left after `timeout_s`. Generous:
        an agent killed before its teardown leaves its cgroup tree, and four stop at once on a loaded machine."""
        for node in reversed(list(self.nodes.values())):
            if node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    node.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        for node in self.nodes.values():
            try:
                node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()

    def shutdown(self) -> None:
        """Undo everything; never raises, so that it is safe in any teardown."""
        with contextlib.suppress(Exception):
            self.stop_agents()
        for ns in self._namespaces:  # whatever the agents left (workers, fork servers)
            with contextlib.suppress(Exception):
                _kill_pids(namespace_pids(ns))
        for cmd in reversed(self._undo):
            with contextlib.suppress(Exception):
                ip(*cmd, check=False)
        self._undo.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "NetnsCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _read_line(fd: int, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> str:
    deadline = time.monotonic() + timeout_s
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise RuntimeError(f"the node agent did not start within {timeout_s:.0f} s; see {log_path}")
        chunk = os.read(fd, 256)
        if not chunk:
            raise RuntimeError(f"the node agent exited with {proc.wait()} before listening; see {log_path}:\n"
                               + log_path.read_text(errors="replace")[-3000:])
        buf += chunk
    return buf.decode().strip()


# ---- a train function that says where it runs ------------------------------------------------


def located_counting_loop(config: dict) -> None:
    """`counting_loop`, after logging which network namespace (hence node) this rank runs in."""
    log_event(config, event="where", netns=netns_inode())
    counting_loop(config)
