"""Simulated nodes and the head's node table.

`NodeModel` is what the simulator needs of a node. The default is `AgentNode`
(outlast/sim/agent_node.py), run by the agent's real supervisor. `SimNode` here is the
simple model it replaced, kept because the regression seeds of the controller's first bugs
were drawn against it: it spawns and stops workers, answers the run's heartbeats, kills a
run's workers when its driver falls silent (and a dead driver's workers when a relaunched
driver spawns the same run), refuses work while draining, tells each run with workers there
of a drain, and dies with its workers at a drain's deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from outlast.protocol import messages as m
from outlast.sim.workers import SimRank

if TYPE_CHECKING:
    from outlast.sim.driver import SimDriver
    from outlast.sim.run import Sim

HEAD_DEAD_AFTER_S = 3.0  # the head declares a silent member dead after this
NODE_CHECK_S = 1.0
TERM_S = 0.05  # SIGTERM to exit


class NodeModel(Protocol):
    node_id: str
    alive: bool
    agent_pid: int
    workers: dict

    def start(self) -> None: ...

    def kill_worker(self, rank: int) -> SimRank | None: ...

    def wedge_worker(self, rank: int, until: float = 0.0) -> SimRank | None: ...

    def worker_exited(self, w: SimRank, code: int | None, signal: int | None, error: m.WorkerError | None) -> None: ...

    def agent_gone(self) -> str | None: ...

    def from_driver(self, driver: "SimDriver", msg: m.Msg) -> None: ...

    def drain(self, notice: m.NodeDraining) -> None: ...

    def die(self) -> None: ...

    def info(self, now: float) -> m.NodeInfo: ...


@dataclass
class _Run:
    driver: "SimDriver"
    last_heard: float
    timeout_s: float
    key: str = ""
    ended: bool = False


@dataclass
class SimNode:
    sim: "Sim"
    node_id: str
    cpus: int
    alive: bool = True
    agent_pid: int = 0
    died_at: float | None = None
    draining: m.NodeDraining | None = None
    workers: dict[tuple[str, int, int], SimRank] = field(default_factory=dict)
    runs: dict[str, _Run] = field(default_factory=dict)

    def start(self) -> None:
        self.sim.world.after(NODE_CHECK_S, self._check)

    # ---- requests from a controller -------------------------------------------------

    def from_driver(self, driver: "SimDriver", msg: m.Msg) -> None:
        if not self.alive:
            return
        now = self.sim.world.now
        if isinstance(msg, m.RunHeartbeat):
            run = self.runs.setdefault(msg.run_id, _Run(driver, now, msg.timeout_s))
            run.last_heard, run.timeout_s, run.driver = now, msg.timeout_s, driver
            driver.from_node(self.node_id, m.Pong(node_id=self.node_id, pid=0))
        elif isinstance(msg, m.SpawnWorkers):
            self._spawn(driver, msg, now)
        elif isinstance(msg, m.StopWorkers):
            for w in [w for w in self.workers.values() if w.run_id == msg.run_id and w.attempt == msg.attempt]:
                self.sim.world.after(TERM_S, self._terminate, w)
        elif isinstance(msg, m.EndRun):
            run = self.runs.get(msg.run_id)
            if run is not None:
                run.ended = True
            for w in [w for w in self.workers.values() if w.run_id == msg.run_id]:
                self.sim.world.after(TERM_S, self._terminate, w)

    def _spawn(self, driver: "SimDriver", msg: m.SpawnWorkers, now: float) -> None:
        if self.draining is not None:
            driver.from_node(self.node_id, m.SpawnRefused(run_id=msg.run_id, attempt=msg.attempt, reason=(
                f"node {self.node_id} is draining ({self.draining.reason}: {self.draining.message})")))
            return
        run = self.runs.setdefault(msg.run_id, _Run(driver, now, 5.0))
        run.key = msg.run_key
        for w in [w for w in self.workers.values() if w.run_id != msg.run_id
                  and self.runs.get(w.run_id) is not None and self.runs[w.run_id].key == msg.run_key]:
            self._terminate(w, signal=9)  # a relaunched driver's run: the old driver's workers go first
        gang = driver.gang(msg.attempt, msg.workers[0].world_size)
        for spec in msg.workers:
            w = SimRank(self.sim, self, msg, spec, gang, driver.worker_channel(msg.attempt, spec.rank),
                        driver.worker_channel(msg.attempt, spec.rank, uploads=True))
            self.workers[(msg.run_id, msg.attempt, spec.rank)] = w
            self.sim.observer.worker_started(w)
            driver.from_node(self.node_id, m.WorkerStarted(run_id=msg.run_id, attempt=msg.attempt, rank=spec.rank,
                                                           pid=0))
            self.sim.world.after(self.sim.world.rng.uniform(0.001, 0.2), w.start)

    # ---- workers ------------------------------------------------------------------------

    def _terminate(self, w: SimRank, signal: int = 15) -> None:
        if w.alive and self.alive:
            w.kill()
            self.worker_exited(w, None, signal, None)

    def worker_exited(self, w: SimRank, code: int | None, signal: int | None, error: m.WorkerError | None) -> None:
        w.alive = False
        self.sim.observer.worker_gone(w)
        if self.workers.get((w.run_id, w.attempt, w.rank)) is w:
            del self.workers[(w.run_id, w.attempt, w.rank)]
        if code != 0:
            w.gang.break_()
        run = self.runs.get(w.run_id)
        if run is not None and self.alive:
            run.driver.from_node(self.node_id, m.WorkerExited(
                run_id=w.run_id, attempt=w.attempt, rank=w.rank, pid=0, exit_code=code, signal=signal, error=error,
                node_id=self.node_id))

    def wedge_worker(self, rank: int, until: float = 0.0) -> SimRank | None:
        for w in self.workers.values():
            if w.rank == rank and w.alive and not w.wedged:
                w.wedge()
                return w
        return None

    def kill_worker(self, rank: int) -> SimRank | None:
        for w in list(self.workers.values()):
            if w.rank == rank and w.alive:
                w.kill()
                self.worker_exited(w, None, 9, None)
                return w
        return None

    def _check(self) -> None:
        """The agent kills the workers of a run whose driver fell silent."""
        if not self.alive:
            return
        now = self.sim.world.now
        for run_id, run in list(self.runs.items()):
            if now - run.last_heard > run.timeout_s:
                for w in [w for w in self.workers.values() if w.run_id == run_id]:
                    self._terminate(w, signal=9)
                del self.runs[run_id]
        self.sim.world.after(NODE_CHECK_S, self._check)

    # ---- drains and deaths ----------------------------------------------------------

    def drain(self, notice: m.NodeDraining) -> None:
        if not self.alive or self.draining is not None:
            return
        self.draining = notice
        for run_id in sorted({w.run_id for w in self.workers.values()}):
            run = self.runs.get(run_id)
            if run is not None:
                run.driver.from_node(self.node_id, notice)

    def die(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.died_at = self.sim.world.now
        for w in list(self.workers.values()):
            w.kill()
            self.sim.observer.worker_gone(w)
        self.workers.clear()

    def agent_gone(self) -> str | None:
        return None

    def info(self, now: float) -> m.NodeInfo:
        used: dict[str, dict[str, float]] = {}
        for w in self.workers.values():
            used.setdefault(w.run_id, {"CPU": 0.0})["CPU"] += 1.0
        if not self.alive and now - (self.died_at or now) >= HEAD_DEAD_AFTER_S:
            state = "dead"
        else:
            state = "draining" if self.draining is not None else "alive"
        return m.NodeInfo(node_id=self.node_id, address=f"sim://{self.node_id}", host=self.node_id,
                          resources={"CPU": float(self.cpus)}, state=state, draining=self.draining, used=used)


def node_table(nodes: list[NodeModel], now: float) -> list[m.NodeInfo]:
    return [n.info(now) for n in nodes]

