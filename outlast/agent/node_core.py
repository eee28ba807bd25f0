"""What a node's agent does with a controller's request, its fork server's reports and a drain,
without a socket, a process or a clock.

`Agent` (`agent.py`) drives it from its poll loop; the simulator's node (`outlast/sim/agent_node.py`)
drives the same object on a virtual clock. It holds the node's `Supervisor` and whether the node
drains, and returns the supervisor's effects plus two of its own: `Fork` (ask the fork server for
a workload, whose placement the supervisor now expects) and `FinishOutput` (send a workload's or a
run's last output lines before what follows). Requests about the cluster (the node's role),
status and output files are the agent's: `on_request` answers None for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from outlast.agent.gpus import GpuBook
from outlast.agent.supervisor import (UNKILLABLE_AFTER_S, Effect, Key, ExpectedWorkload, Send, Supervisor, Warn, Workload,
                                      spawn_refusal)
from outlast.protocol import messages as m
from outlast.threads import cpu_share_threads


@dataclass(frozen=True)
class Fork:
    """Ask the fork server for a workload: worker `spec` of `spawn`, or the task `task`. `leaf` names
    its cgroup leaf, where isolation makes one (`ExpectedWorkload.leaf` is then set by the agent)."""

    key: Key
    leaf: str
    placement: ExpectedWorkload
    spawn: m.SpawnWorkers | None = None
    spec: m.WorkerSpec | None = None
    task: m.SpawnTask | None = None
    env: dict[str, str] | None = None  # a worker's environment when it is not the spawn's: with its GPUs
    threads: int = 1  # its share of the node's CPUs, in threads (outlast/threads.py)


@dataclass(frozen=True)
class FinishOutput:
    """Send the last output lines of one workload (`key`), or of every workload of the run (`key` None),
    to the run's controller (`to`; None: the run is unknown here, the lines go nowhere)."""

    to: bytes | None
    run_id: str
    key: Key | None = None


NodeEffect = Effect | Fork | FinishOutput


class NodeCore:
    def __init__(self, node_id: str, pid: int, gpu_ids: list[str] | None = None,
                 unkillable_after_s: float = UNKILLABLE_AFTER_S, cpus: float = 1.0) -> None:
        self.node_id, self.pid = node_id, pid  # pid: the agent's, which a SpawnWorkers names as the one placed on
        self.cpus = cpus  # what workloads may use, which their threads share
        self.sup = Supervisor(node_id, unkillable_after_s)
        self.gpus: GpuBook[Key] = GpuBook(list(gpu_ids or []))  # which live worker holds which of the node's GPUs
        self.draining: m.NodeDraining | None = None
        # Spawns that wait for workers of an earlier attempt of their run to exit (run id, attempt) -> (to, spawn)
        self.held: dict[tuple[str, int], tuple[bytes, m.SpawnWorkers]] = {}

    # ---- requests -------------------------------------------------------------------------------

    def on_request(self, to: bytes, req: m.AgentRequest, now: float, head_address: str = "") -> list[NodeEffect] | None:
        """A request about runs and their workloads; None for any other (the agent answers those)."""
        if isinstance(req, m.RunHeartbeat):
            self.sup.heartbeat(to, req, now)
            return [Send(to, self.pong(head_address)), *self._release_held()]
        if isinstance(req, m.Ping):
            return [Send(to, self.pong(head_address))]
        if isinstance(req, m.SpawnWorkers):
            return self._spawn(to, req, now)
        if isinstance(req, m.SpawnTask):
            return self._spawn_task(to, req, now)
        if isinstance(req, m.StopWorkers):
            return [*self._refuse_held(lambda k: k == (req.run_id, req.attempt), "stopped before its workers started"),
                    *self.sup.stop_attempt(req.run_id, req.attempt, req.grace_s, now)]
        if isinstance(req, m.KillRanks):
            return [*self.sup.kill_ranks(req.run_id, req.attempt, req.ranks, req.reason)]
        if isinstance(req, m.EndRun):
            return [*self._refuse_held(lambda k: k[0] == req.run_id, "ended before its workers started"),
                    self._finish_output(req.run_id, None), *self.sup.end_run(req.run_id, now)]
        return None

    def pong(self, head_address: str = "") -> m.Pong:
        return m.Pong(node_id=self.node_id, pid=self.pid, head_address=head_address)

    def _spawn(self, to: bytes, req: m.SpawnWorkers, now: float) -> list[NodeEffect]:
        if (why := spawn_refusal(self.node_id, self.draining, req.agent_pid, self.pid)) is not None:
            return [Send(to, m.SpawnRefused(run_id=req.run_id, attempt=req.attempt, reason=why))]
        effects: list[NodeEffect] = list(self.sup.admit(to, req.run_id, now, req.run_key))
        if blockers := self._earlier_workers(req):
            # A new attempt never runs beside its run's earlier one (they would share its checkpoint directory
            # and the node's resources); killed, those go soon, or are given up and the node drains.
            self.held[(req.run_id, req.attempt)] = (to, req)
            return effects + [Warn(f"run {req.run_id}: attempt {req.attempt} waits to start here until pids "
                                   f"{blockers} of an earlier attempt of its run, being killed, have exited")]
        return effects + self._forks(to, req)

    def _earlier_workers(self, req: m.SpawnWorkers) -> list[int]:
        """Live workers here of an earlier attempt of `req`'s run, its own or an older driver's (same run key)."""
        def earlier(w: Workload) -> bool:
            if w.run_id == req.run_id:
                return w.attempt < req.attempt
            run = self.sup.runs.get(w.run_id)
            return bool(req.run_key) and run is not None and run.run_key == req.run_key
        return sorted(w.pid for w in self.sup.workloads.values() if not w.is_task and earlier(w))

    def _release_held(self) -> list[NodeEffect]:
        out: list[NodeEffect] = []
        for key, (to, req) in list(self.held.items()):
            if not self._earlier_workers(req):
                del self.held[key]
                out += self._forks(to, req)
        return out

    def _refuse_held(self, which: Callable[[tuple[str, int]], bool], why: str) -> list[NodeEffect]:
        out: list[NodeEffect] = []
        for key in [k for k in self.held if which(k)]:
            to, req = self.held.pop(key)
            out.append(Send(to, m.SpawnRefused(run_id=req.run_id, attempt=req.attempt,
                                               reason=f"node {self.node_id}: attempt {req.attempt} {why}")))
        return out

    def _forks(self, to: bytes, req: m.SpawnWorkers) -> list[NodeEffect]:
        envs = self.gpus.worker_envs([(req.run_id, req.attempt, s.rank, "") for s in req.workers],
                                     req.resources.get("GPU", 0.0), req.env)
        if isinstance(envs, str):
            return [Send(to, m.SpawnRefused(run_id=req.run_id, attempt=req.attempt, reason=f"node {self.node_id}: {envs}"))]
        effects: list[NodeEffect] = []
        threads = cpu_share_threads(req.resources.get("CPU"), self.cpus, len(req.workers))
        for spec in req.workers:
            key = (req.run_id, req.attempt, spec.rank, "")
            placement = ExpectedWorkload(world_size=spec.world_size, demand=dict(req.resources))
            self.sup.expect(key, placement)
            effects.append(Fork(key, f"{req.run_id}-a{req.attempt}-r{spec.rank}", placement, spawn=req, spec=spec,
                                env=envs[key], threads=threads))
        return effects

    def _spawn_task(self, to: bytes, req: m.SpawnTask, now: float) -> list[NodeEffect]:
        effects: list[NodeEffect] = list(self.sup.admit(to, req.run_id, now))
        demand = {"CPU": req.resources.num_cpus}
        if req.resources.memory_bytes:
            demand["memory"] = float(req.resources.memory_bytes)
        key = (req.run_id, 0, -1, req.task_id)
        placement = ExpectedWorkload(resources=req.resources, retriable=req.retriable, demand=demand)
        self.sup.expect(key, placement)
        return effects + [Fork(key, f"task-{req.task_id}", placement, task=req,
                               threads=cpu_share_threads(req.resources.num_cpus, self.cpus, 1))]

    # ---- the fork server ------------------------------------------------------------------------

    def on_fork_server(self, msg: m.Forked | m.Reaped, wall: float) -> list[NodeEffect]:
        """`wall`: now on the wall clock (when a workload started, as the memory policy compares it)."""
        if isinstance(msg, m.Forked):
            return list(self.sup.on_forked(msg, wall))
        # Its last lines, then its exit.
        key = (msg.run_id, msg.attempt, msg.rank, msg.task_id)
        self.gpus.release(key)
        return [self._finish_output(msg.run_id, key), *self.sup.on_reaped(msg), *self._release_held()]

    def _finish_output(self, run_id: str, key: Key | None) -> FinishOutput:
        run = self.sup.runs.get(run_id)  # before the end is told: that may forget the run
        return FinishOutput(run.controller if run is not None else None, run_id, key)

    # ---- drains ---------------------------------------------------------------------------------

    def drain(self, notice: m.NodeDraining) -> list[NodeEffect]:
        """Take no new workers; tell every run with workloads here (forks on their way included)."""
        self.draining = notice
        return [*self._refuse_held(lambda k: True, f"was not started: the node is draining ({notice.message})"),
                *(Send(run.controller, notice) for run in self.sup.runs_with_workloads())]
