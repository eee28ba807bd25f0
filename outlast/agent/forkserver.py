"""The agent's handle on its fork server (outlast/agent/zygote.py): the process and the pipe to it.

A server that died is started again (`died`, then `restart_if_due`), later each time it keeps
dying, until its restart policy gives up; what is asked of it in between waits here and goes to
the new server, which reads it once its modules are imported.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

from outlast.agent.worker_user import WorkerUser
from outlast.agent.worker_user import encode as encode_user
from outlast.client.restarts import GiveUp, Restart, RestartPolicy, describe_exit
from outlast.protocol import messages as m
from outlast.runenv import without_secrets
from outlast.protocol.transport import FROM_ZYGOTE, encode


class ForkServer:
    def __init__(self, preload: list[str], worker_user: WorkerUser | None = None) -> None:
        self.preload = preload
        self.worker_user = worker_user
        self.ready = False
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.starts = 0
        self.restarts = RestartPolicy()
        self.restart_at: float | None = None
        self._waiting: list[m.ForkWorker | m.ForkTask] = []
        self.start()

    def died(self, now: float) -> tuple[str, Restart | GiveUp]:
        """After an end of file: reap it, and plan its restart or give up (the policy's decision,
        with its reason). Returns how it ended too."""
        how = describe_exit(self.reap())
        decision = self.restarts.on_death(now, how)
        if isinstance(decision, Restart):
            self.restart_at = decision.at
        return how, decision

    def restart_if_due(self, now: float) -> bool:
        if self.restart_at is None or now < self.restart_at:
            return False
        self.restart_at = None
        self.start()
        self.restarts.restarted(now)
        return True

    @property
    def up(self) -> bool:
        return self.conn is not None

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "outlast.agent.zygote", str(theirs.fileno()), ",".join(self.preload),
             encode_user(self.worker_user) if self.worker_user else ""],
            pass_fds=[theirs.fileno()],
            # Its environment block is every worker's (fork, no exec): never a secret in it.
            env=without_secrets(os.environ),
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False
        self.starts += 1
        waiting, self._waiting = self._waiting, []
        for msg in waiting:
            self.send(msg)

    def fileno(self) -> int:
        assert self.conn is not None
        return self.conn.fileno()

    def send(self, msg: m.ForkWorker | m.ForkTask) -> None:
        if self.conn is None:
            self._waiting.append(msg)
            return
        try:
            self.conn.send_bytes(encode(msg))
        except OSError:
            pass  # it died: the poll loop reads the end of file and reports the fork lost

    def receive(self) -> m.FromZygote | None:
        """The server's next report, or None once it died."""
        assert self.conn is not None
        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError):
            return None
        msg = FROM_ZYGOTE.decode(data)
        if isinstance(msg, m.ZygoteReady):
            self.ready = True
        return msg

    def reap(self, timeout_s: float = 1.0) -> int | None:
        """After an end of file: close the pipe, and return the exit code (negative: the signal)."""
        assert self.conn is not None and self.proc is not None
        self.conn.close()
        self.conn, self.ready = None, False
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # half dead (its pipe closed): it is ours, so it goes
            return self.proc.wait()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()  # the server exits on EOF
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
