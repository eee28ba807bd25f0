"""A real etcd cluster of three members on loopback ports of its own, for the cluster-store tests.

Each member keeps a private data directory; members can be killed (SIGKILL, as a lost machine)
and started again on the same ports and data, so the cluster regains its majority.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def etcd_missing() -> str | None:
    """Why the etcd tests cannot run here, or None."""
    for tool in ("etcd", "etcdctl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (./scripts/setup-etcd installs etcd-server and etcd-client)"
    try:
        import etcd3gw  # noqa: F401
    except ImportError:
        return "etcd3gw is not installed (pip install 'outlast[etcd]')"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class Tls:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def make(cls, d: Path) -> "Tls":
        d.mkdir(parents=True, exist_ok=True)

        def ssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

        ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=outlast-test-ca",
            "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
        (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        for name in ("server", "client"):
            ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(d / f"{name}.key"),
                "-out", str(d / f"{name}.csr"))
            ssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
                "-CAcreateserial", "-days", "1", "-extfile", str(d / "san.cnf"), "-out", str(d / f"{name}.pem"))
        return cls(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen | None = None
    tls: Tls | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"


class EtcdCluster:
    def __init__(self, workdir: Path, size: int = 3, tls: Tls | None = None) -> None:
        """`tls`: clients must connect with TLS and a certificate signed by its CA (peers stay plain)."""
        workdir.mkdir(parents=True, exist_ok=True)
        ports = _free_ports(2 * size)
        self.members = [Member(f"m{i}", ports[2 * i], ports[2 * i + 1], workdir / f"etcd-m{i}",
                               workdir / f"etcd-m{i}.log", tls=tls) for i in range(size)]
        self.tls = tls
        self._initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        self._started_once: set[str] = set()

    @property
    def endpoints(self) -> list[str]:
        return [m.url for m in self.members]

    @property
    def urls(self) -> str:
        return ",".join(self.endpoints)

    def start(self, timeout_s: float = 30.0) -> "EtcdCluster":
        for m in self.members:
            self.start_member(m.name, wait=False)
        self.wait_healthy(timeout_s)
        return self

    def start_member(self, name: str, wait: bool = True, timeout_s: float = 30.0) -> None:
        m = self._member(name)
        assert m.proc is None or m.proc.poll() is not None, f"{name} is running"
        peer = f"http://127.0.0.1:{m.peer_port}"
        cmd = ["etcd", "--name", m.name, "--data-dir", str(m.data_dir),
               "--listen-client-urls", m.url, "--advertise-client-urls", m.url,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", self._initial, "--initial-cluster-token", f"outlast-test-{self.members[0].peer_port}",
               "--initial-cluster-state", "existing" if name in self._started_once else "new",
               "--heartbeat-interval", "100", "--election-timeout", "1000"]
        if m.tls is not None:
            cmd += ["--cert-file", str(m.tls.server_cert), "--key-file", str(m.tls.server_key),
                    "--trusted-ca-file", str(m.tls.ca), "--client-cert-auth"]
        with open(m.log_path, "ab") as log:
            m.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        self._started_once.add(name)
        if wait:
            self.wait_healthy(timeout_s, [m])

    def kill_member(self, name: str) -> None:
        """SIGKILL one member, as a lost machine."""
        m = self._member(name)
        if m.proc is not None and m.proc.poll() is None:
            m.proc.kill()
            m.proc.wait()

    def wait_healthy(self, timeout_s: float = 30.0, members: list[Member] | None = None) -> None:
        """Until every given member (default: all) answers /health with a leader in its cluster."""
        deadline = time.monotonic() + timeout_s
        for m in members or self.members:
            while not self._healthy(m):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd member {m.name} not healthy within {timeout_s:.0f} s; see {m.log_path}")
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"etcd member {m.name} exited with {m.proc.returncode}; see {m.log_path}")
                time.sleep(0.1)

    @staticmethod
    def _healthy(m: Member) -> bool:
        context = None
        if m.tls is not None:
            import ssl

            context = ssl.create_default_context(cafile=str(m.tls.ca))
            context.load_cert_chain(str(m.tls.client_cert), str(m.tls.client_key))
        try:
            with urllib.request.urlopen(m.url + "/health", timeout=1.0, context=context) as r:
                return b'"health":"true"' in r.read().replace(b" ", b"")
        except OSError:
            return False

    def _member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def stop(self) -> None:
        """SIGKILL every member: the data is the test's own, and a graceful stop of a whole cluster
        spends seconds handing leadership to members that are stopping too."""
        for m in self.members:
            self.kill_member(m.name)
