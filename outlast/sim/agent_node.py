"""A simulated node run by the agent's real core (`outlast/agent/node_core.py`, with its supervisor).

The simulator plays what the agent does with sockets and processes: a request from a
controller goes to the core as `outlast/agent/agent.py` gives it; a `Fork` effect becomes a
`SimRank` with a pid, reported as `Forked`; a worker's end is reported as `Reaped`; a `Kill`
effect signals the simulated process (SIGKILL at once, SIGTERM after the worker's handler ran,
or never for a worker that ignores it, until the supervisor's SIGKILL after the grace); a
`Send` is an agent event to the controller on the node's channel. The spawn's refusal, the
drain's notices, heartbeat expiry (a dead driver) and the retirement of a relaunched driver's
predecessor all come from the core.

Faults of the node's own processes: the fork server dies (its workloads with it, reported
lost by `lose_all`, the node stays and the server comes back per the agent's restart policy),
and the agent dies (the node is lost; a persistent agent comes back with the same node id
and a new pid).
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from outlast.client.restarts import GiveUp, RestartPolicy
from outlast.agent.node_core import Fork, NodeCore, NodeEffect
from outlast.agent.supervisor import GiveUpNode, Kill, Send, Warn
from outlast.protocol import messages as m
from outlast.protocol.transport import INCARNATION_VAR
from outlast.sim.cluster import HEAD_DEAD_AFTER_S
from outlast.sim.tier import COPY_BYTES, SimTier
from outlast.sim.workers import SimRank

if TYPE_CHECKING:
    from outlast.sim.driver import SimDriver
    from outlast.sim.run import Sim

TICK_S = 0.1  # the agent's timers' period
FORK_S = (0.001, 0.05)  # the fork server's answer
START_S = (0.001, 0.2)  # from the fork to the worker's hello
TERM_S = 0.05  # a worker's SIGTERM handler exits this soon ...
IGNORES_TERM = 0.05  # ... except this share of workers, stuck in a collective: the grace's SIGKILL ends them
SIM_HOST = "sim-host"  # the drivers' machine: a process there sees at once when an agent there is gone


class AgentNode:
    def __init__(self, sim: "Sim", node_id: str, cpus: int, same_host: bool = False) -> None:
        self.sim, self.node_id, self.cpus, self.same_host = sim, node_id, cpus, same_host
        self.alive = False
        self.died_at: float | None = None
        self.agent_pid = 0
        self.incarnations = 0
        spec = sim.schedule.tier
        self.tier = SimTier(self, spec.budget_copies * COPY_BYTES) if spec is not None else None
        index = int(node_id[1:]) if node_id[1:].isdigit() else 0
        self.failure_domain = f"d{index % spec.domains}" if spec is not None and spec.domains else ""
        self.local: dict[str, dict[str, bytes]] = {}  # the node's disk: a rank's checkpoint directory -> its files

    @property
    def workers(self) -> dict[int, SimRank]:
        return self.procs

    def start(self) -> None:
        """The agent starts (again): an empty core, a new pid, a fresh fork server."""
        self.alive, self.died_at = True, None
        self.incarnations += 1
        self.agent_pid = self.sim.new_pid()
        self.core = NodeCore(self.node_id, self.agent_pid, cpus=self.cpus)
        self.sup = self.core.sup
        self.procs: dict[int, SimRank] = {}
        self.groups: dict[int, SimRank] = {}  # every rank forked here, by its process group's id (its pid)
        self.drivers: dict[bytes, "SimDriver"] = {}
        self.fork_policy = RestartPolicy()
        self.fork_gen, self.fork_up = 0, True
        self.fork_queue: list[tuple["SimDriver", m.SpawnWorkers, m.WorkerSpec]] = []
        self._tick_at: float | None = None
        if self.tier is not None:
            self.tier.reclaim()
        self._tick_soon()

    # ---- requests from a controller ------------------------------------------------------------------

    def from_driver(self, driver: "SimDriver", msg: m.Msg) -> None:
        if not self.alive:
            return
        self.drivers[driver.identity] = driver
        self.apply(self.core.on_request(driver.identity, msg, self.sim.world.now) or [])
        self._tick_soon()

    # ---- the fork server -------------------------------------------------------------------------

    def _ask_fork(self, f: Fork) -> None:
        run = self.sup.runs.get(f.key[0])
        driver = self.drivers.get(run.controller) if run is not None else None
        if driver is not None and f.spawn is not None and f.spec is not None:
            self._queue_fork(driver, f.spawn, f.spec)

    def _queue_fork(self, driver: "SimDriver", msg: m.SpawnWorkers, spec: m.WorkerSpec) -> None:
        if not self.fork_up:  # queued until it is back, as the agent's fork-server client does
            self.fork_queue.append((driver, msg, spec))
            return
        self.sim.world.after(self.sim.world.rng.uniform(*FORK_S), self._forked, driver, msg, spec, self.fork_gen)

    def _forked(self, driver: "SimDriver", msg: m.SpawnWorkers, spec: m.WorkerSpec, gen: int) -> None:
        if not self.alive or gen != self.fork_gen:
            return  # the fork server that was asked died first: `lose_all` reported the fork lost
        incarnation = int(msg.env.get(INCARNATION_VAR, "0"))
        w = SimRank(self.sim, self, msg, spec, driver.gang(msg.attempt, spec.world_size),
                    driver.worker_channel(msg.attempt, spec.rank, incarnation=incarnation),
                    driver.worker_channel(msg.attempt, spec.rank, uploads=True, incarnation=incarnation))
        w.pid = self.sim.new_pid()
        self.procs[w.pid] = w
        self.groups[w.pid] = w
        self.sim.observer.worker_started(w)
        self.apply(self.core.on_fork_server(m.Forked(run_id=msg.run_id, attempt=msg.attempt, rank=spec.rank,
                                                     pid=w.pid), self.sim.wall()))
        self.sim.world.after(self.sim.world.rng.uniform(*START_S), self._start_worker, w)

    def _start_worker(self, w: SimRank) -> None:
        if w.alive:
            w.start()

    def fork_server_dies(self) -> None:
        """Its workers die with it (nobody reaps them); the supervisor reports them and the forks in
        flight lost, and the server is started again per the agent's restart policy."""
        if not self.alive or not self.fork_up:
            return
        for w in list(self.procs.values()):
            self._vanish(w)
        self.fork_gen += 1
        self.fork_up = False
        how = "killed by SIGKILL"
        self.apply(self.sup.lose_all(f"the fork server of node {self.node_id} died ({how}); its workers died with it"))
        decision = self.fork_policy.on_death(self.sim.world.now, how)
        if isinstance(decision, GiveUp):
            self.sim.world.note(f"node {self.node_id}: {decision.reason}; stopping the node")
            self.agent_dies()
            return
        self.sim.world.at(decision.at + self.sim.world.rng.uniform(0.2, 2.0), self._fork_server_back, self.fork_gen)

    def _fork_server_back(self, gen: int) -> None:
        if not self.alive or gen != self.fork_gen:
            return
        self.fork_up = True
        self.fork_policy.restarted(self.sim.world.now)
        queued, self.fork_queue = self.fork_queue, []
        for driver, msg, spec in queued:
            self._queue_fork(driver, msg, spec)

    # ---- processes -------------------------------------------------------------------------------

    def apply(self, effects: list[NodeEffect]) -> None:
        for e in effects:
            if isinstance(e, Fork):
                self._ask_fork(e)
            elif isinstance(e, Send):
                driver = self.drivers.get(e.to)
                if driver is not None:
                    driver.from_node(self.node_id, e.msg)
            elif isinstance(e, Kill):
                self.sim.observer.on_kill(self.node_id, e)
                self._signal(e.pid, e.sig)
            elif isinstance(e, GiveUpNode):  # the agent drains itself, as a drain-node order would
                self.sim.drain_node(self, e.reason)
            elif isinstance(e, Warn) and self.sim.world.tracing:
                self.sim.world.note(f"node {self.node_id}: {e.text}")

    def _signal(self, pid: int, sig: int) -> None:
        """A `Kill` signals the workload's process group: its children too, whether it lives or not."""
        group = self.groups.get(pid)
        if group is not None:
            self._end_children(group)
        w = self.procs.get(pid)
        if w is None or not w.alive:
            return
        if (stuck := w.unkillable_until - self.sim.world.now) > 0:
            if sig == signal.SIGKILL and stuck != float("inf"):  # delivered once it is out of the kernel
                self.sim.world.after(stuck, self._signal, pid, sig)
            return
        if sig == signal.SIGKILL:
            w.kill()
            self.worker_exited(w, None, signal.SIGKILL, None)
        elif self.sim.world.rng.random() >= IGNORES_TERM:
            self.sim.world.after(TERM_S, self._terminated, w)

    def _terminated(self, w: SimRank) -> None:
        if w.alive and self.procs.get(w.pid) is w:
            w.kill()
            self.worker_exited(w, None, signal.SIGTERM, None)

    def worker_exited(self, w: SimRank, code: int | None, sig: int | None, error: m.WorkerError | None) -> None:
        """The fork server reaped it, killing its process group first (`zygote.py`); the core reports its end."""
        w.alive = False
        self._end_children(w)
        self.sim.observer.worker_gone(w)
        if self.procs.pop(w.pid, None) is None:
            return
        if code != 0:
            w.gang.break_()
        self.apply(self.core.on_fork_server(m.Reaped(run_id=w.run_id, attempt=w.attempt, rank=w.rank, pid=w.pid,
                                                     exit_code=code, signal=sig, error=error), self.sim.wall()))
        self._tick_soon()

    def _vanish(self, w: SimRank, children_too: bool = False) -> None:
        """A worker dies with its parent: nobody reaps or reports it here. Its children live on unless
        `children_too` (the machine goes, or the fork server ends them on its way out)."""
        w.kill()
        if children_too:
            self._end_children(w)
        self.sim.observer.worker_gone(w)
        self.procs.pop(w.pid, None)

    def _end_children(self, w: SimRank) -> None:
        self.sim.observer.children_ended(w, w.children)
        w.children = set()

    def wedge_worker(self, rank: int, until: float = 0.0) -> SimRank | None:
        """It stops in user code; `until` > now: in the kernel, where no signal reaches it before then."""
        for w in self.procs.values():
            if w.rank == rank and w.alive and not w.wedged:
                w.wedge()
                w.unkillable_until = until
                return w
        return None

    def kill_worker(self, rank: int) -> SimRank | None:
        """Someone else's SIGKILL (the kernel's OOM killer, a user): the rank alone, not its group."""
        for w in list(self.procs.values()):
            if w.rank == rank and w.alive and w.unkillable_until <= self.sim.world.now:
                w.kill()
                self.worker_exited(w, None, signal.SIGKILL, None)
                return w
        return None

    # ---- time --------------------------------------------------------------------------------------

    def _tick_soon(self) -> None:
        """The agent's timers run every 100 ms; here only when one of them is due (a kill deadline, a
        run's heartbeat timeout), which keeps thousands of schedules fast."""
        if not self.alive:
            return
        sup, now, inf = self.sup, self.sim.world.now, float("inf")
        due = inf  # called at every message from a driver: one pass, no lists
        for w in sup.workloads.values():
            if w.kill_at is None:
                continue
            if w.kill_at != inf:
                t = w.kill_at
            elif w.given_up:
                continue
            else:  # a workload SIGKILLed and not reaped: seen by the next tick, given up after the timeout
                t = now if w.killed_at is None else w.killed_at + sup.unkillable_after_s
            if t < due:
                due = t
        for r in sup.runs.values():
            if not r.ended and r.last_heard + r.timeout_s < due:
                due = r.last_heard + r.timeout_s
        if due == inf:
            return
        at = max(due + TICK_S, self.sim.world.now)
        if self._tick_at is None or at < self._tick_at or self._tick_at < self.sim.world.now:
            self._tick_at = at
            self.sim.world.at(at, self._tick, self.incarnations, at)

    def _tick(self, incarnation: int, at: float) -> None:
        if not self.alive or incarnation != self.incarnations or at != self._tick_at:
            return
        self._tick_at = None
        self.apply(self.sup.tick(self.sim.world.now))
        self._tick_soon()

    # ---- drains and deaths -------------------------------------------------------------------------

    def drain(self, notice: m.NodeDraining) -> None:
        """As the agent's timers take a drain order: only while the node is not draining already."""
        if self.alive and self.core.draining is None:
            self.apply(self.core.drain(notice))

    def die(self) -> None:
        """The machine is gone, and everything on it: not the drivers' machine, whose processes would be gone too."""
        self.same_host = False
        self.agent_dies()
        self.local.clear()
        if self.tier is not None:
            self.tier.lose()

    def agent_dies(self) -> None:
        """The agent's process ends; its fork server and workers end with it."""
        if not self.alive:
            return
        self.alive = False
        self.died_at = self.sim.world.now
        for w in list(self.procs.values()):
            self._vanish(w, children_too=True)  # the fork server's SIGTERM ends every group (`zygote.py`)

    def agent_gone(self) -> str | None:
        """What a driver on the same machine sees of the agent's pid: why it is lost, or None."""
        if self.alive or not self.same_host:
            return None
        return f"the node agent of node {self.node_id} (pid {self.agent_pid}) is gone: killed by SIGKILL"

    def info(self, now: float) -> m.NodeInfo:
        if not self.alive and now - (self.died_at or now) >= HEAD_DEAD_AFTER_S:
            state = "dead"
        else:
            state = "draining" if self.core.draining is not None else "alive"
        return m.NodeInfo(node_id=self.node_id, address=f"sim://{self.node_id}", host=self.node_id,
                          resources={"CPU": float(self.cpus)}, state=state, draining=self.core.draining,
                          used=self.sup.usage() if self.alive else {}, agent_pid=self.agent_pid,
                          host_id=SIM_HOST if self.same_host else "", failure_domain=self.failure_domain,
                          tier_address=self.tier.address if self.tier is not None else "")
