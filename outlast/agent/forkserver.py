"""The agent's handle on its fork server (outlast/agent/zygote.py): the process and the pipe to it."""

from __future__ import annotations

import socket
import subprocess
import sys
from multiprocessing.connection import Connection

from outlast.protocol import messages as m
from outlast.protocol.transport import FROM_ZYGOTE, encode


class ForkServer:
    def __init__(self, preload: list[str]) -> None:
        self.preload = preload
        self.ready = False
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "outlast.agent.zygote", str(theirs.fileno()), ",".join(preload)],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.conn = Connection(ours.detach())

    def fileno(self) -> int:
        return self.conn.fileno()

    def send(self, msg: m.ForkWorker | m.ForkTask) -> bool:
        """False when the server is gone (its death reaches the poll loop as an end of file)."""
        try:
            self.conn.send_bytes(encode(msg))
        except OSError:
            return False
        return True

    def receive(self) -> m.FromZygote | None:
        """The server's next report, or None once it died."""
        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError):
            return None
        msg = FROM_ZYGOTE.decode(data)
        if isinstance(msg, m.ZygoteReady):
            self.ready = True
        return msg

    def exit_status(self, timeout_s: float = 1.0) -> int | None:
        """Its exit code (negative: the signal), waiting a little for the process to be reaped."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        self.conn.close()  # the server exits on EOF
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
