"""How a driver or the CLI finds the node agent on this machine, or starts one."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import zmq

from outlast.agent.procutil import pid_alive
from outlast.protocol import messages as m
from outlast.protocol.transport import AGENT_EVENTS, BadMessage, connect_dealer, encode


class NodeFile(msgspec.Struct):
    address: str
    pid: int
    node_id: str


class AgentUnavailable(RuntimeError):
    pass


def state_dir() -> Path:
    return Path(os.environ.get("OUTLAST_HOME") or f"/tmp/outlast-{os.getuid()}")


def node_file_path() -> Path:
    return state_dir() / "node.json"


def write_node_file(info: NodeFile) -> None:
    path = node_file_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.encode(info))
    os.replace(tmp, path)


def read_node_file() -> NodeFile | None:
    try:
        return msgspec.json.decode(node_file_path().read_bytes(), type=NodeFile)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def remove_node_file(owner_pid: int) -> None:
    info = read_node_file()
    if info is not None and info.pid == owner_pid:
        node_file_path().unlink(missing_ok=True)


def request(ctx: zmq.Context, address: str, msg: m.Msg, timeout_s: float = 2.0) -> m.AgentEvent:
    """One request, one reply, or `AgentUnavailable`."""
    sock = connect_dealer(ctx, address)
    try:
        sock.send(encode(msg))
        if not sock.poll(int(timeout_s * 1000)):
            raise AgentUnavailable(f"no answer from the node agent at {address} within {timeout_s:.0f} s")
        try:
            return AGENT_EVENTS.decode(sock.recv())
        except BadMessage as e:
            raise AgentUnavailable(f"the node agent at {address} answered with a malformed message: {e}") from None
    finally:
        sock.close(linger=0)


def find_running_agent(ctx: zmq.Context) -> str | None:
    """The address of a live agent: $OUTLAST_ADDRESS, or the one `outlast start` published."""
    explicit = os.environ.get("OUTLAST_ADDRESS")
    if explicit:
        address = explicit if "://" in explicit else f"tcp://{explicit}"
        request(ctx, address, m.Ping(), timeout_s=5.0)  # a wrong address must fail loudly, not start a node
        return address
    info = read_node_file()
    if info is None or not pid_alive(info.pid):
        return None
    try:
        request(ctx, info.address, m.Ping(), timeout_s=2.0)
    except AgentUnavailable:
        return None
    return info.address


def start_agent_process(preload: list[str], embedded: bool, extra_args: list[str] | None = None,
                        log_path: Path | None = None, timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start `python -m outlast.agent` and return it with its address once it listens."""
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "outlast.agent", "--ready-fd", str(w), "--preload", ",".join(preload)]
    if embedded:
        cmd.append("--embedded")
    cmd += extra_args or []
    out = open(log_path, "ab") if log_path else None
    try:
        # Its own session: a Ctrl+C in the terminal reaches the driver, which tears down in order.
        proc = subprocess.Popen(cmd, pass_fds=[w], start_new_session=True, stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL)
    finally:
        os.close(w)
        if out:
            out.close()
    try:
        deadline = time.monotonic() + timeout_s
        buf = b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                proc.kill()
                raise AgentUnavailable(f"the node agent did not start within {timeout_s:.0f} s")
            chunk = os.read(r, 256)
            if not chunk:
                code = proc.wait()
                where = f"; see {log_path}" if log_path else ""
                raise AgentUnavailable(f"the node agent exited with code {code} during start-up{where}")
            buf += chunk
    finally:
        os.close(r)
    return proc, buf.decode().strip()
