"""The node a driver or an Executor starts for itself when no cluster runs here, started again
when it dies.

The node's agent is outlast's own process: an OOM kill of it, a bug, or a mistaken `kill` must
cost the run one restart, not the run. A watcher thread waits on the agent (reaping it at
once, so the controller sees the pid gone on its next tick: outlast/client/liveness.py) and
starts a new one on the same address, with a new node id: the controller counts the old node
lost (one failure of the run, its history saying what died and how) and places the next
attempt on the new one. A node that keeps dying soon after its start is given up on, with
the reason in the log; the run then waits for capacity and says so. An Executor, which has no
controller watching the node table, hears of each death and restart through `on_change`.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import threading
import time
from typing import Callable

from outlast.client.restarts import GiveUp, RestartPolicy, describe_exit
from outlast.client.discovery import AgentLaunch, AgentUnavailable, launch_agent, start_agent_process
from outlast.client.liveness import note_exit
from outlast.protocol.auth import ClusterKey
from outlast.trace import mark

log = logging.getLogger("outlast.client")


STANDBY_VAR = "OUTLAST_AGENT_STANDBY"  # "0": keep no standby agent (its memory: docs/benchmarks.md)
# The standby imports torch: seconds of CPU. Not while the agent's own fork server imports and the
# first workers start, which it would slow; the standby is started once the agent has lived this long.
STANDBY_AFTER_S = 10.0


class EmbeddedNode:
    def __init__(self, proc: subprocess.Popen[bytes], address: str, key: ClusterKey, preload: list[str],
                 extra_args: list[str], on_change: "Callable[[str, str], None] | None" = None,
                 standby: bool | None = None) -> None:
        """`on_change(state, what)`, from the watcher thread: "died" (`what` says how, and that
        it comes back), "restarted" once its successor listens, or "gone" when it does not come
        back (`what` says why).

        A standby agent is kept beside it (unless `standby` is False or $OUTLAST_AGENT_STANDBY is 0):
        a second agent process, started by the same thread, that has imported what it needs and
        started its fork server, and waits; when the agent dies it binds the same address at once."""
        self.proc = proc
        self.address = address
        self._args = [*extra_args, "--port", address.rsplit(":", 1)[1]]
        self._key = key
        self._preload = preload
        self._policy = RestartPolicy(what="the embedded node agent")
        self._stopping = threading.Event()
        self._on_change = on_change or (lambda state, what: None)
        self._standby_on = os.environ.get(STANDBY_VAR, "1") != "0" if standby is None else standby
        self.standby: AgentLaunch | None = None
        # Started from a thread, the agent dies with that thread (PR_SET_PDEATHSIG): this one lives
        # until stop(), so a restarted agent (and the standby) lives as long as the driver.
        self._thread = threading.Thread(target=self._watch, name="outlast-embedded-node", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            proc = self.proc
            if self._standby_on and self.standby is None and not _ends_within(proc, STANDBY_AFTER_S):
                self._keep_standby()
            how = describe_exit(_wait_unreaped(proc))
            if self._stopping.is_set():
                proc.wait()
                return
            decision = self._policy.on_death(time.monotonic(), how)
            mark("embedded.agent_died", agent=proc.pid)
            # Said before the pid is reaped: the controller, seeing it gone, finds how it went.
            what = f"the embedded node agent died ({how}); " + (
                decision.reason if isinstance(decision, GiveUp) else "the driver restarts it")
            note_exit(proc.pid, what)
            proc.wait()
            if isinstance(decision, GiveUp):
                log.error("%s", decision.reason)
                self._end_standby()
                self._on_change("gone", what)
                return
            self._on_change("died", what)
            if decision.at > time.monotonic() and self._stopping.wait(decision.at - time.monotonic()):
                return
            try:
                self.proc = self._successor()
            except AgentUnavailable as e:
                log.error("the embedded node agent died (%s) and could not be started again: %s", how, e)
                self._on_change("gone", f"the embedded node agent died ({how}) and could not be started again: {e}")
                return
            if self._stopping.is_set():  # fit() ended while the new node started
                self.proc.terminate()
                self.proc.wait()
                return
            mark("embedded.agent_restarted", agent=self.proc.pid)
            self._policy.restarted(time.monotonic())
            self._on_change("restarted", f"the embedded node agent was restarted (pid {self.proc.pid})")
            log.warning("the embedded node agent (pid %d) died (%s); the driver restarted it (pid %d) at %s",
                        proc.pid, how, self.proc.pid, self.address)

    def _keep_standby(self) -> None:
        if not self._stopping.is_set():
            try:
                self.standby = launch_agent(self._preload, embedded=True, extra_args=self._args, env=self._key.env,
                                            standby=True)
            except OSError as e:
                log.warning("could not start a standby node agent (%s); a restart will start one from scratch", e)

    def _successor(self) -> subprocess.Popen[bytes]:
        """The standby, told to take over; a new agent if there is none, or it died meanwhile."""
        standby, self.standby = self.standby, None
        if standby is not None:
            standby.go()
            try:
                standby.address()
                return standby.proc
            except AgentUnavailable as e:
                log.warning("the standby node agent (pid %d) could not take over (%s); starting a new one",
                            standby.proc.pid, e)
        proc, _ = start_agent_process(self._preload, embedded=True, extra_args=self._args, env=self._key.env)
        return proc

    def _end_standby(self) -> None:
        standby, self.standby = self.standby, None
        if standby is None:
            return
        standby.close_go()  # a standby exits at the end of its pipe
        os.close(standby.ready_fd)
        try:
            standby.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            standby.proc.kill()
            standby.proc.wait()

    def stop(self) -> None:
        self._stopping.set()
        proc = self.proc
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._thread.join(timeout=5)
        self._end_standby()


def _ends_within(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether the child ends within `timeout_s` (left unreaped)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # already reaped
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def _wait_unreaped(proc: subprocess.Popen[bytes]) -> int | None:
    """Wait for the child to end but leave it to be reaped (its pid stays taken until then);
    returns its exit code as Popen gives it (negative: the signal)."""
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        return proc.wait()
    if info is None:
        return None
    return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status
