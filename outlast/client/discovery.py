"""How a driver or the CLI finds the node agent on this machine, or starts one."""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from outlast.runenv import secrets_in, without_secrets, write_secrets
from outlast.identity import ProcessIdentity, still_running
from outlast.protocol import messages as m
from outlast.protocol.auth import AuthError, ClusterKey, connect_checked, start_authenticator
from outlast.protocol.transport import AGENT_EVENTS, BadMessage, VersionMismatch, tune, encode
from outlast.statedir import state_dir
from outlast.trace import mark

log = logging.getLogger("outlast.client")


class NodeFile(msgspec.Struct):
    address: str
    pid: int
    node_id: str
    process: ProcessIdentity | None = None  # to tell the agent from whoever has its pid later
    # The agent's pid namespace ("pid:[4026531836]"): its pid means nothing in another one, such as
    # outside the container it runs in. Empty: written by an older outlast.
    pid_namespace: str = ""


def pid_namespace() -> str:
    """This process's pid namespace, as /proc names it ("pid:[INODE]"); empty where there is no /proc."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def node_elsewhere() -> NodeFile | None:
    """The node `outlast start` published in $OUTLAST_HOME if it did so in another pid namespace: whether it
    runs cannot be told from its pid here, only by asking it at its address."""
    info = read_node_file()
    return info if info is not None and _in_another_namespace(info) else None


def _in_another_namespace(info: NodeFile) -> bool:
    here = pid_namespace()
    return bool(info.pid_namespace and here and info.pid_namespace != here)


def elsewhere_message(info: NodeFile, command: str | None = "status") -> str:
    """That the node `info` names was started in another pid namespace, and how `outlast COMMAND` reaches it."""
    what = (f"the node {info.node_id} in {state_dir()} was started in another pid namespace "
            f"({info.pid_namespace}; this process is in {pid_namespace()}), where its pid {info.pid} means nothing")
    if command is None:
        return what
    ask = f"OUTLAST_ADDRESS={info.address.split('://', 1)[-1]} outlast status"
    how = f"or ask it by its address: {ask}" if command == "status" else f"(`{ask}` asks it from here)"
    return f"{what}: run `outlast {command}` inside it (e.g. in its container), {how}"


class AgentUnavailable(RuntimeError):
    pass


def node_file_path() -> Path:
    return state_dir() / "node.json"


def cluster_key_path() -> Path:
    return state_dir() / "cluster.key"


def find_cluster_key() -> "ClusterKey | None":
    """The key this machine's drivers and tools use: $OUTLAST_CLUSTER_SECRET, the file
    $OUTLAST_CLUSTER_KEY, or the one `outlast start` wrote in $OUTLAST_HOME."""
    key = ClusterKey.from_env()
    if key is not None:
        return key
    path = os.environ.get("OUTLAST_CLUSTER_KEY")
    if path:
        return ClusterKey.load(path)  # named but missing: say so rather than fail to connect
    if cluster_key_path().exists():
        return ClusterKey.load(cluster_key_path())
    return None


def write_node_file(info: NodeFile) -> None:
    path = node_file_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.encode(info))
    os.replace(tmp, path)


# A node file is a few hundred bytes; one larger than this was not written by an agent, and is not read whole.
NODE_FILE_MAX_BYTES = 64 * 1024


def read_node_file() -> NodeFile | None:
    """The node this machine's agent announced, or None: no file, or one that is not an agent's."""
    path = node_file_path()
    try:
        with path.open("rb") as f:
            data = f.read(NODE_FILE_MAX_BYTES + 1)
    except OSError:
        return None
    if len(data) > NODE_FILE_MAX_BYTES:
        log.warning("ignoring %s: it is larger than a node file can be (%d bytes); remove it if no agent runs here",
                    path, NODE_FILE_MAX_BYTES)
        return None
    try:
        return msgspec.json.decode(data, type=NodeFile)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def remove_node_file(owner_pid: int) -> None:
    info = read_node_file()
    if info is not None and info.pid == owner_pid:
        node_file_path().unlink(missing_ok=True)


def request(ctx: zmq.Context[zmq.Socket[bytes]], address: str, msg: m.Msg, timeout_s: float = 2.0,
            key: "ClusterKey | None | bool" = True) -> m.AgentEvent:
    """One request, one reply, or `AgentUnavailable` (`key=True`: this machine's cluster key)."""
    if key is True:
        try:
            key = find_cluster_key()
        except AuthError as e:
            raise AgentUnavailable(str(e)) from None
    sock = tune(ctx.socket(zmq.DEALER))
    try:
        if key:
            key.connect_as_client(sock)
            try:
                connect_checked(sock, address, int(timeout_s * 1000))
            except AuthError as e:
                raise AgentUnavailable(str(e)) from None
        else:
            sock.connect(address)
        sock.send(encode(msg))
        if not sock.poll(int(timeout_s * 1000)):
            hint = "" if key else ("; if it was started with a cluster key, give this machine a copy "
                                   "(OUTLAST_CLUSTER_KEY=FILE)")
            raise AgentUnavailable(f"no answer from the node agent at {address} within {timeout_s:.0f} s{hint}")
        try:
            return AGENT_EVENTS.decode(sock.recv())
        except VersionMismatch as e:
            raise AgentUnavailable(f"the node agent at {address} refused this request: {e}") from None
        except BadMessage as e:
            raise AgentUnavailable(f"the node agent at {address} answered with a malformed message: {e}") from None
    finally:
        sock.close(linger=0)


NODE_ANSWER_S = 30.0  # how long a node that runs may take to answer; a starved machine can take seconds


def published_node() -> NodeFile | None:
    """The node `outlast start` published in $OUTLAST_HOME, if the process that published it still runs
    (in this pid namespace: `node_elsewhere` tells the other case)."""
    info = read_node_file()
    if info is None or _in_another_namespace(info):
        return None
    return info if still_running(info.process, info.pid)[0] else None


def find_running_agent(ctx: zmq.Context[zmq.Socket[bytes]], answer_within_s: float | None = None) -> str | None:
    """The address of a live agent: $OUTLAST_ADDRESS, or the one `outlast start` published.

    A published node whose process runs is waited for (`answer_within_s`, NODE_ANSWER_S unless
    given), never passed over: were a slow answer taken for no node, the caller would start an
    embedded one without that node's settings (its resource isolation first).
    """
    within = NODE_ANSWER_S if answer_within_s is None else answer_within_s
    explicit = os.environ.get("OUTLAST_ADDRESS")
    if explicit:
        address = explicit if "://" in explicit else f"tcp://{explicit}"
        request(ctx, address, m.Ping(), timeout_s=within)  # a wrong address must fail loudly
        return address
    info = published_node()
    if info is None:
        return None
    try:
        request(ctx, info.address, m.Ping(), timeout_s=within)
    except AgentUnavailable as e:
        raise AgentUnavailable(f"the node `outlast start` started on this machine (pid {info.pid}) runs but did "
                               f"not answer: {e}; wait until it does, or stop it with `outlast stop`") from None
    return info.address


def head_of(ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> str:
    """The head of the cluster the agent at `address` belongs to (itself when it is the head)."""
    pong = request(ctx, address, m.Ping(), timeout_s=NODE_ANSWER_S)
    return pong.head_address if isinstance(pong, m.Pong) and pong.head_address else address


@dataclass
class ClusterAccess:
    """What a driver needs to use a cluster: its head, its key, and the node it started, if any."""

    head_address: str
    key: ClusterKey
    embedded: subprocess.Popen[bytes] | None = None
    authenticator: Any = None

    def stop_authenticator(self) -> None:
        """Before the context's term(): the authenticator's thread holds a socket on it."""
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None


def attach(ctx: zmq.Context[zmq.Socket[bytes]], preload: list[str], extra_args: list[str] | None = None) -> ClusterAccess:
    """Use the running cluster, or start an embedded node that dies with this process.

    The context gets an authenticator for the cluster key, so sockets bound on it admit
    only peers with the key.
    """
    address = find_running_agent(ctx)
    if address is not None:
        key = find_cluster_key()
        if key is None:
            raise AgentUnavailable(f"the node at {address} needs its cluster key: copy it from the head's "
                                   f"$OUTLAST_HOME/cluster.key and set OUTLAST_CLUSTER_KEY=FILE")
        access = ClusterAccess(head_of(ctx, address), key)
    else:
        elsewhere = node_elsewhere()
        if elsewhere is not None:
            log.warning("%s; this driver starts a node of its own (OUTLAST_ADDRESS=%s makes it use that one)",
                        elsewhere_message(elsewhere, None), elsewhere.address.split("://", 1)[-1])
        key = ClusterKey.generate()  # a private cluster of one node: nobody else gets in
        proc, address = start_agent_process(preload, embedded=True, extra_args=extra_args, env=key.env)
        access = ClusterAccess(address, key, proc)
    access.authenticator = start_authenticator(ctx, access.key)
    return access


def start_agent_process(preload: list[str], embedded: bool, extra_args: list[str] | None = None,
                        log_path: Path | None = None, timeout_s: float = 30.0,
                        env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start `python -m outlast.agent` and return it with its address once it listens.

    The cluster key and etcd's password (in `env` or this process's environment) go to it over a
    pipe, never in its environment: its fork server, and so every worker, could read them there."""
    launch = launch_agent(preload, embedded, extra_args, log_path, env)
    return launch.proc, launch.address(timeout_s)


@dataclass
class AgentLaunch:
    """An agent process on its way up; a standby's (`go_fd` set) waits for `go()` before it binds."""

    proc: subprocess.Popen[bytes]
    ready_fd: int
    log_path: Path | None = None
    go_fd: int | None = None

    def go(self) -> None:
        """Tell a standby to become the node's agent (its predecessor is gone)."""
        assert self.go_fd is not None
        try:
            os.write(self.go_fd, b"go\n")
        except OSError:
            pass  # it died: address() says so
        self.close_go()

    def close_go(self) -> None:
        if self.go_fd is not None:
            os.close(self.go_fd)  # a standby still waiting exits at the end of file
            self.go_fd = None

    def address(self, timeout_s: float = 30.0) -> str:
        """Its address once it listens; raises AgentUnavailable (the process ended) when it does not in time."""
        r, proc = self.ready_fd, self.proc
        try:
            deadline = time.monotonic() + timeout_s
            buf = b""
            while not buf.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    proc.kill()
                    proc.wait()
                    raise AgentUnavailable(f"the node agent did not start within {timeout_s:.0f} s")
                chunk = os.read(r, 256)
                if not chunk:
                    code = proc.wait()
                    where = f"; see {self.log_path}" if self.log_path else ""
                    raise AgentUnavailable(f"the node agent exited with code {code} during start-up{where}")
                buf += chunk
        finally:
            os.close(r)
            self.close_go()
        return buf.decode().strip()


def launch_agent(preload: list[str], embedded: bool, extra_args: list[str] | None = None,
                 log_path: Path | None = None, env: dict[str, str] | None = None,
                 standby: bool = False) -> AgentLaunch:
    """Start `python -m outlast.agent`; with `standby`, one that imports what it needs and starts its fork
    server, then waits for `AgentLaunch.go()` before it binds (outlast/client/embedded.py)."""
    mark("driver.agent_launch", standby=standby)
    full_env = {**os.environ, **(env or {})}
    secrets_fd = write_secrets(secrets_in(full_env))
    r, w = os.pipe()
    go_r, go_w = os.pipe() if standby else (None, None)
    cmd = [sys.executable, "-m", "outlast.agent", "--ready-fd", str(w), "--secrets-fd", str(secrets_fd),
           "--preload", ",".join(preload)]
    if embedded:
        cmd.append("--embedded")
    if go_r is not None:
        cmd += ["--standby-fd", str(go_r)]
    cmd += extra_args or []
    out = open(log_path, "ab") if log_path else None
    try:
        # Its own session: a Ctrl+C in the terminal reaches the driver, which tears down in order.
        proc = subprocess.Popen(cmd, pass_fds=[fd for fd in (w, secrets_fd, go_r) if fd is not None],
                                start_new_session=True, stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, env=without_secrets(full_env))
    except BaseException:
        os.close(r)
        if go_w is not None:
            os.close(go_w)
        raise
    finally:
        for fd in (w, secrets_fd, go_r):
            if fd is not None:
                os.close(fd)
        if out:
            out.close()
    return AgentLaunch(proc, r, log_path, go_w)
