"""The agent's handle on its fork server (outlast/agent/zygote.py): the process and the pipe to it,
and a standby.

A fresh fork server imports the preloaded modules again (torch: seconds, and tens of seconds on a
busy machine) before it can fork, so its death would cost the run that long. So once the server
is ready, has forked everything asked of it, and forked nothing in the last `STANDBY_AFTER_FORKS_S`,
it is asked to fork a standby (`ForkStandby`): a copy of itself, its modules imported already,
sharing its pages, that waits on a socket of its own and forks nothing. When the server dies, the
standby takes its place at once, what is asked of it goes to the standby, and the new server is
asked for a new standby (by the restart policy: later each time servers keep dying, and never once
it gives up). With no server at all, a fresh one is started, and what is asked waits here for it,
which reads it once its modules are imported. `OUTLAST_FORK_SERVER_STANDBY=0` keeps no standby.

A server started here is the agent's child: it leads its own session, is a subreaper and gets
SIGTERM when the agent dies. A standby is its server's child, and outlives it (that is its use);
it ends when its socket to the agent does, or with its server when the server is stopped. The agent
holds a pidfd of each server it did not start, so that it waits for and, if it must, kills that very
process, never another that took its pid.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle

from outlast.agent import fork_request
from outlast.agent.worker_user import WorkerUser
from outlast.agent.worker_user import encode as encode_user
from outlast.client.restarts import GiveUp, Restart, RestartPolicy, describe_exit
from outlast.procutil import FORK_SERVER_MODULE
from outlast.protocol import messages as m
from outlast.runenv import without_secrets
from outlast.protocol.transport import FROM_ZYGOTE, encode
from outlast.trace import mark

STANDBY_VAR = "OUTLAST_FORK_SERVER_STANDBY"
STANDBY_RETRY_S = 30.0  # a standby that died by itself (not on the restart path) is replaced after this
# A standby's imports take the CPU for seconds: never while workers start. It waits until no fork was
# asked for this long (the forks of a restart come together).
STANDBY_AFTER_FORKS_S = 2.0


@dataclass
class _Server:
    """A fork server: started here (`proc`), or a standby its server forked (`pidfd`, once it said its pid)."""

    proc: subprocess.Popen[bytes] | None
    conn: Connection
    ready: bool = False
    pid: int = 0
    pidfd: int = -1

    def __post_init__(self) -> None:
        if self.proc is not None:
            self.pid = self.proc.pid


class ForkServer:
    def __init__(self, preload: list[str], worker_user: WorkerUser | None = None,
                 standby: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.preload = preload
        self.worker_user = worker_user
        self.standby_enabled = os.environ.get(STANDBY_VAR, "1") != "0" if standby is None else standby
        self.clock = clock
        self.active: _Server | None = None
        self.spare: _Server | None = None
        self.starts = 0
        self.takeovers = 0  # deaths the standby answered
        self.restarts = RestartPolicy()
        self.restart_at: float | None = None  # when the next server (or standby) may start
        self.given_up = False
        self.last_fork = clock()
        # Forks asked of the active server that it has not reported forked: a standby never starts while one is on
        # its way (a server that is still importing reads the first run's requests only once it is ready).
        self.forks_pending = 0
        self._waiting: list[tuple[m.ForkChild, m.ForkWorker | m.ForkTask]] = []
        self.start()

    # ---- what the agent reads ----------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self.active is not None

    @property
    def ready(self) -> bool:
        return self.active is not None and self.active.ready

    @property
    def pid(self) -> int:
        """The active server's pid (0: none, or a standby that took over before it said its pid)."""
        return self.active.pid if self.active is not None else 0

    @property
    def standby_pid(self) -> int:
        """The standby's pid once it is ready to take over, else 0."""
        return self.spare.pid if self.spare is not None and self.spare.ready else 0

    def fileno(self) -> int:
        assert self.active is not None
        return self.active.conn.fileno()

    def fds(self) -> set[int]:
        """What the agent polls: the server's pipe, and the standby's (its ready, or its end)."""
        return {s.conn.fileno() for s in (self.active, self.spare) if s is not None}

    # ---- life and death ----------------------------------------------------------------------

    def died(self, now: float) -> tuple[str, Restart | GiveUp]:
        """After an end of file: reap it, and plan its restart or give up (the policy's decision,
        with its reason). A standby takes its place at once. Returns how it ended too."""
        mark("agent.forkserver_died")
        assert self.active is not None
        how = describe_exit(_reap(self.active))
        self.active = None
        self.forks_pending = 0  # its forks died with it; the restart asks for its own
        decision = self.restarts.on_death(now, how)
        if isinstance(decision, GiveUp):
            self.given_up = True
            self._end_spare()
            return how, decision
        self.restart_at = decision.at
        if self.spare is not None:
            self.active, self.spare = self.spare, None
            self.takeovers += 1
            self.last_fork = now  # the restart's forks are on their way: the next standby waits for them
            self.restarts.restarted(now)
            mark("agent.standby_took_over", server=self.active.pid, ready=self.active.ready)
            self._send_waiting()
            when = "now" if decision.at <= now else f"in {decision.at - now:.0f} s"
            decision = Restart(decision.at, f"the fork server died ({how}); its standby (pid {self.active.pid}) "
                                            f"took its place, and a new standby starts {when}")
        return how, decision

    def restart_if_due(self, now: float) -> str | None:
        """Start the server, or a standby beside a ready one, when one is missing and its time has come.
        Returns a line for the log saying which was started, or None."""
        if self.given_up or (self.restart_at is not None and now < self.restart_at):
            return None
        if self.active is None:
            self.restart_at = None
            started = self.start()
            self.restarts.restarted(now)
            return f"started the fork server again (pid {started.pid})"
        # A fork asked for and not reported is waited for (a request the server dropped, at most STANDBY_RETRY_S).
        wait_s = STANDBY_RETRY_S if self.forks_pending else STANDBY_AFTER_FORKS_S
        if self.standby_enabled and self.spare is None and self.active.ready and now - self.last_fork >= wait_s:
            self.restart_at = None
            self.spare = self._fork_standby(self.active)
            mark("agent.standby_start", server=self.active.pid)
            return f"asked the fork server (pid {self.active.pid}) for a standby"
        return None

    def on_standby(self) -> str | None:
        """The standby's pipe is readable: it is ready, or it died (then a line for the log)."""
        assert self.spare is not None
        try:
            msg = FROM_ZYGOTE.decode(self.spare.conn.recv_bytes())
        except (EOFError, OSError):
            how = describe_exit(_reap(self.spare))
            pid, self.spare = self.spare.pid, None
            self.restart_at = self.clock() + STANDBY_RETRY_S
            return f"the standby fork server (pid {pid or 'not known yet'}) died ({how}); another in " \
                   f"{STANDBY_RETRY_S:.0f} s"
        if isinstance(msg, m.ZygoteReady):
            if self.spare.proc is None:
                self.spare.pid, self.spare.pidfd = msg.pid, _pidfd(msg.pid)
            self.spare.ready = True
            mark("agent.standby_ready", server=self.spare.pid)
        return None

    def start(self) -> _Server:
        active = self.active = self._spawn()
        self._send_waiting()
        return active

    def _spawn(self) -> _Server:
        mark("agent.forkserver_start")
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-m", FORK_SERVER_MODULE, str(theirs.fileno()), ",".join(self.preload),
             encode_user(self.worker_user) if self.worker_user else ""],
            pass_fds=[theirs.fileno()],
            # Its environment block is every worker's (fork, no exec): never a secret in it.
            env=without_secrets(os.environ),
        )
        theirs.close()
        self.starts += 1
        return _Server(proc, Connection(ours.detach()))

    @staticmethod
    def _fork_standby(server: _Server) -> _Server | None:
        """Ask `server` to fork a standby serving a new socket; None when the server is gone (its end is read)."""
        ours, theirs = socket.socketpair()
        try:
            server.conn.send_bytes(encode(m.ForkStandby()))
            send_handle(server.conn, theirs.fileno(), server.pid)
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        return _Server(None, Connection(ours.detach()))

    def _send_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for order, request in waiting:
            self.send(order, request)

    # ---- the pipe ----------------------------------------------------------------------------

    def send(self, order: m.ForkChild, request: m.ForkWorker | m.ForkTask) -> None:
        """Ask for `order`'s child; `request` (the run's secrets) goes to the child alone, in a memfd
        the server passes on unread (outlast/agent/fork_request.py)."""
        self.last_fork = self.clock()
        if self.active is None:
            self._waiting.append((order, request))
            return
        self.forks_pending += 1
        fd = fork_request.sealed(request)
        try:
            self.active.conn.send_bytes(encode(order))
            send_handle(self.active.conn, fd, self.active.pid)
        except OSError:
            pass  # it died: the poll loop reads the end of file and reports the fork lost
        finally:
            os.close(fd)

    def receive(self) -> m.FromZygote | None:
        """The server's next report, or None once it died."""
        assert self.active is not None
        try:
            data = self.active.conn.recv_bytes()
        except (EOFError, OSError):
            return None
        msg = FROM_ZYGOTE.decode(data)
        if isinstance(msg, m.Forked):
            self.forks_pending = max(0, self.forks_pending - 1)
            self.last_fork = self.clock()  # the wait for a standby counts from the fork itself
        elif isinstance(msg, m.ZygoteReady):
            mark("agent.forkserver_ready", server=self.active.pid)
            self.active.ready = True
        return msg

    def close(self) -> None:
        for s in (self.active, self.spare):
            if s is None:
                continue
            if s.ready or s.proc is None:
                try:
                    s.conn.send_bytes(encode(m.StopForking()))  # an ordinary end, not the agent's death
                except OSError:
                    pass
            else:
                s.proc.terminate()  # still importing: it has forked nothing, and need not finish
            s.conn.close()
        deadline = time.monotonic() + 5.0  # one for both: they end side by side, and the agent's stop has a budget
        for s in (self.active, self.spare):
            if s is not None:
                _wait(s, max(0.0, deadline - time.monotonic()))
        self.active = self.spare = None

    def _end_spare(self) -> None:
        if self.spare is not None:
            _reap(self.spare, end=True)
            self.spare = None


def _reap(s: _Server, timeout_s: float = 1.0, end: bool = False) -> int | None:
    """Close the pipe (a server exits on EOF) and return the exit code (negative: the signal; None: a standby,
    whose exit status is its parent's)."""
    s.conn.close()
    return _wait(s, 5.0 if end else timeout_s)


def _wait(s: _Server, timeout_s: float) -> int | None:
    """Wait for `s` to end, killing it past `timeout_s` (half dead, its pipe closed, or deaf: it is ours)."""
    if s.proc is not None:
        try:
            return s.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            return s.proc.wait()
    if s.pidfd < 0:  # a standby that never said its pid: its server, which forked it, ends it (or its socket did)
        return None
    try:
        if not select.select([s.pidfd], [], [], timeout_s)[0]:
            signal.pidfd_send_signal(s.pidfd, signal.SIGKILL)
            select.select([s.pidfd], [], [], 5.0)
    except ProcessLookupError:
        pass
    finally:
        os.close(s.pidfd)
        s.pidfd = -1
    return None


def _pidfd(pid: int) -> int:
    """A pidfd of the standby that just said it is ready (its socket open, so it is alive: the pid is its)."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return -1
