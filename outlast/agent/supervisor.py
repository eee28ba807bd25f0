"""The node's supervisor: the table of workloads and runs, and what to do about them.

Pure: no sockets, no processes, no clock. Every method takes the time as an argument and
returns effects, each with its reason; the agent (outlast/agent/agent.py) carries them out,
and a simulator can drive the same object on a virtual clock. A workload is a training
worker (a rank of an attempt) or an executor task: one model, `task_id` tells them apart.

Times: `now` is the agent's monotonic clock (heartbeats, kill deadlines); `wall` is
wall-clock seconds (when a workload started, as the memory policy compares it with the
controller's commit times).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from outlast.isolation.policy import render_report
from outlast.protocol.kinds import WorkloadKind
from outlast.protocol import messages as m
from outlast.protocol.kinds import FailureKind

END_RUN_GRACE_S = 1.0
# A workload still not reaped this long after its SIGKILL is stuck in the kernel (an NFS or FUSE
# read, a GPU fault, a frozen cgroup): its exit is reported without it, and the node given up.
UNKILLABLE_AFTER_S = 30.0
DEFAULT_RUN_TIMEOUT_S = 5.0  # until the run's first heartbeat says otherwise


@dataclass
class Workload:
    run_id: str
    attempt: int
    rank: int  # -1 for a task
    pid: int
    task_id: str = ""  # "" for a training worker
    kill_at: float | None = None  # SIGKILL deadline once a SIGTERM went out; inf once SIGKILLed
    leaf: str | None = None  # its cgroup leaf, with isolation on
    started_at: float = 0.0  # wall clock
    resources: m.Resources = m.Resources()
    retriable: bool = True
    world_size: int = 1
    kill_report: m.KillReport | None = None  # set when outlast killed it for memory
    demand: dict[str, float] = field(default_factory=dict)  # what it holds of the node's resources
    killed_at: float | None = None  # when the first tick saw it SIGKILLed
    given_up: bool = False  # reported as unkillable: its exit was already told

    @property
    def is_task(self) -> bool:
        return bool(self.task_id)


@dataclass(frozen=True)
class ExpectedWorkload:
    """What is known of a workload before the fork server reports its pid."""

    leaf: str | None = None
    resources: m.Resources = m.Resources()
    retriable: bool = True
    world_size: int = 1
    demand: dict[str, float] = field(default_factory=dict)


@dataclass
class Run:
    run_id: str
    controller: bytes  # the controller's identity on the agent's socket
    timeout_s: float
    last_heard: float
    stopped_attempts: set[int] = field(default_factory=set)
    ended: bool = False
    last_commit_at: float | None = None  # wall clock, from the controller's heartbeat
    saved_for_drain_at: float | None = None  # the same
    run_key: str = ""


# ---- effects: what the agent must do, and why ------------------------------------------------

@dataclass(frozen=True)
class Kill:
    """Signal the workload's process group."""

    pid: int
    sig: int
    reason: str


@dataclass(frozen=True)
class Send:
    """A message to a run's controller (or any peer) on the agent's socket."""

    to: bytes
    msg: m.Msg


@dataclass(frozen=True)
class ReleaseLeaf:
    """The workload is gone: free its cgroup leaf and what it left in it."""

    pid: int
    leaf: str | None


@dataclass(frozen=True)
class Warn:
    text: str


@dataclass(frozen=True)
class GiveUpNode:
    """A workload did not die after SIGKILL: drain this node so that nothing new is placed here."""

    reason: str


Effect = Kill | Send | ReleaseLeaf | Warn | GiveUpNode
Key = tuple[str, int, int, str]  # (run id, attempt, rank, task id)


@dataclass(frozen=True)
class WorkloadView:
    """A workload as the memory guard sees it: a copy, never the table."""

    pid: int
    leaf: str | None
    kind: WorkloadKind
    owner: str  # run id or task id
    rank: int | None
    started_at: float
    resources: m.Resources
    idle: bool  # being torn down already
    retriable: bool
    world_size: int
    last_commit_at: float | None
    already_killed: bool


def spawn_refusal(node_id: str, draining: m.NodeDraining | None, placed_on: int, agent_pid: int) -> str | None:
    """Why this agent turns a SpawnWorkers away, or None: a draining node takes no work, and an agent
    started since the controller's node table was read is not the one it placed on."""
    if draining is not None:
        return f"node {node_id} is draining ({draining.reason}: {draining.message})"
    if placed_on and placed_on != agent_pid:
        return (f"node {node_id}'s agent was started again (pid {placed_on}, now {agent_pid}) since the node "
                "table the workers were placed with")
    return None


class Supervisor:
    def __init__(self, node_id: str, unkillable_after_s: float = UNKILLABLE_AFTER_S) -> None:
        self.node_id = node_id
        self.unkillable_after_s = unkillable_after_s
        self.runs: dict[str, Run] = {}
        self.workloads: dict[int, Workload] = {}
        self._placements: dict[Key, ExpectedWorkload] = {}

    # ---- runs -------------------------------------------------------------------------------

    def heartbeat(self, to: bytes, beat: m.RunHeartbeat, now: float) -> None:
        run = self._touch(to, beat.run_id, now, beat.timeout_s)
        run.timeout_s, run.last_commit_at, run.saved_for_drain_at = \
            beat.timeout_s, beat.last_commit_at, beat.saved_for_drain_at

    def admit(self, to: bytes, run_id: str, now: float, run_key: str = "") -> list[Effect]:
        """A controller asks for workloads: its run is alive now. A run key seen under an older run id
        means a new driver holds the run's lease: the old driver is dead, so its workers go at once
        instead of after the heartbeat timeout."""
        run = self._touch(to, run_id, now)
        if not run_key:
            return []
        run.run_key = run_key
        effects: list[Effect] = []
        for old in list(self.runs.values()):
            if old is run or old.run_key != run_key or old.ended:
                continue
            effects.append(Warn(f"run {run_key} was relaunched by a new driver; killing the old driver's workers"))
            effects += self._kill_run(old, f"run {run_key}: a new driver took over from run {old.run_id}")
        return effects

    def expect(self, key: Key, placement: ExpectedWorkload) -> None:
        """A fork is on its way: remember where it goes until the fork server reports its pid."""
        self._placements[key] = placement

    def stop_attempt(self, run_id: str, attempt: int, grace_s: float, now: float) -> list[Effect]:
        run = self.runs.get(run_id)
        if run is not None:
            run.stopped_attempts.add(attempt)
        victims = [w for w in self.workloads_of(run_id) if w.attempt == attempt and not w.is_task]
        return self._terminate(victims, grace_s, now, f"run {run_id}: attempt {attempt} stopped by its controller")

    def kill_ranks(self, run_id: str, attempt: int, ranks: list[int], reason: str) -> list[Effect]:
        """SIGKILL some ranks of an attempt, the others left running: no grace, as a stopped process ignores
        SIGTERM. Their exits are reported as any other."""
        victims = [w for w in self.workloads_of(run_id) if w.attempt == attempt and not w.is_task and w.rank in ranks]
        for w in victims:
            w.kill_at = float("inf")
        return [Kill(w.pid, signal.SIGKILL, f"run {run_id}: {reason}") for w in victims]

    def end_run(self, run_id: str, now: float) -> list[Effect]:
        run = self.runs.get(run_id)
        if run is None:
            return []
        run.ended = True
        live = self.workloads_of(run_id)
        if not live:
            del self.runs[run_id]
        return self._terminate(live, END_RUN_GRACE_S, now, f"run {run_id} ended")

    # ---- the fork server's reports ---------------------------------------------------------------

    def on_forked(self, msg: m.Forked, wall: float) -> list[Effect]:
        p = self._placements.pop((msg.run_id, msg.attempt, msg.rank, msg.task_id), None) or ExpectedWorkload()
        self.workloads[msg.pid] = Workload(
            msg.run_id, msg.attempt, msg.rank, msg.pid, task_id=msg.task_id, started_at=wall, leaf=p.leaf,
            resources=p.resources, retriable=p.retriable, world_size=p.world_size, demand=p.demand)
        run = self.runs.get(msg.run_id)
        if run is None or run.ended or (not msg.task_id and msg.attempt in run.stopped_attempts):
            return [Kill(msg.pid, signal.SIGKILL, f"run {msg.run_id}: attempt {msg.attempt} was stopped before "
                                                  f"its worker was born")]
        if msg.task_id:
            return []
        return [Send(run.controller, m.WorkerStarted(run_id=msg.run_id, attempt=msg.attempt, rank=msg.rank,
                                                     pid=msg.pid, output_file=msg.output_file))]

    def on_reaped(self, msg: m.Reaped) -> list[Effect]:
        w = self.workloads.pop(msg.pid, None)
        effects: list[Effect] = [ReleaseLeaf(msg.pid, w.leaf if w else None)]
        if w is not None and w.given_up:
            return effects + [Warn(f"pid {msg.pid} (run {w.run_id}), given up as unkillable, died at last")]
        return effects + self._report_exit(msg.run_id, msg.attempt, msg.rank, msg.task_id, msg.pid, msg.exit_code,
                                           msg.signal, msg.error, w.kill_report if w else None)

    def lose_all(self, why: str) -> list[Effect]:
        """The fork server died and its workloads with it (they die with their parent): nobody will
        reap them, so each is reported lost now, as a failure its run restarts from. So is each fork
        it was asked for and never reported: without a report its controller would wait for it."""
        error = m.WorkerError(kind=FailureKind.FORK_SERVER_DIED, message=why, traceback="", phase="node")
        effects: list[Effect] = []
        for w in list(self.workloads.values()):
            del self.workloads[w.pid]
            effects += [Kill(w.pid, signal.SIGKILL, why), ReleaseLeaf(w.pid, w.leaf)]
            effects += self._report_exit(w.run_id, w.attempt, w.rank, w.task_id, w.pid, None, signal.SIGKILL, error,
                                         w.kill_report)
        for (run_id, attempt, rank, task_id), p in list(self._placements.items()):
            effects.append(ReleaseLeaf(0, p.leaf))
            effects += self._report_exit(run_id, attempt, rank, task_id, 0, None, None, error, None)
        self._placements.clear()
        return effects

    def oom_kill(self, pid: int, report: m.KillReport) -> list[Effect]:
        w = self.workloads.get(pid)
        if w is None:
            return []
        w.kill_report, w.kill_at = report, float("inf")
        return [Kill(pid, signal.SIGKILL, f"memory: {report.trigger}")]

    # ---- time ---------------------------------------------------------------------------------

    def tick(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for w in list(self.workloads.values()):
            if w.kill_at is not None and now >= w.kill_at and w.kill_at != float("inf"):
                w.kill_at = float("inf")
                effects.append(Kill(w.pid, signal.SIGKILL, f"run {w.run_id}: still alive after its grace"))
            if w.kill_at == float("inf") and w.killed_at is None:
                w.killed_at = now
            elif w.killed_at is not None and not w.given_up and now - w.killed_at >= self.unkillable_after_s:
                effects += self._give_up(w, now - w.killed_at)
        for run in list(self.runs.values()):
            silent = now - run.last_heard
            if not run.ended and silent > run.timeout_s:
                effects.append(Warn(f"run {run.run_id}: no heartbeat from its driver for {silent:.1f} s; "
                                    f"killing its workers"))
                effects += self._kill_run(run, f"run {run.run_id}: its driver fell silent")
        return effects

    # ---- views --------------------------------------------------------------------------------

    def workloads_of(self, run_id: str) -> list[Workload]:
        return [w for w in self.workloads.values() if w.run_id == run_id]

    def runs_with_workloads(self) -> list[Run]:
        """Runs with a workload here, or a fork asked for and not reported yet (a drain must reach those too)."""
        ids = {w.run_id for w in self.workloads.values()} | {key[0] for key in self._placements}
        return [self.runs[r] for r in sorted(ids) if r in self.runs]

    def usage(self) -> dict[str, dict[str, float]]:
        """What each run holds of the node's resources."""
        used: dict[str, dict[str, float]] = {}
        for w in self.workloads.values():
            held = used.setdefault(w.run_id, {})
            for k, v in w.demand.items():
                held[k] = held.get(k, 0.0) + v
        return used

    def memory_view(self) -> list[WorkloadView]:
        out = []
        for w in self.workloads.values():
            run = self.runs.get(w.run_id)
            out.append(WorkloadView(
                pid=w.pid, leaf=w.leaf, kind=WorkloadKind.TASK if w.is_task else WorkloadKind.TRAINING,
                owner=w.task_id or w.run_id, rank=None if w.is_task else w.rank, started_at=w.started_at,
                resources=w.resources, idle=w.kill_at is not None or run is None or run.ended, retriable=w.retriable,
                world_size=w.world_size, last_commit_at=run.last_commit_at if run else None,
                already_killed=w.kill_report is not None))
        return out

    # ---- inside -------------------------------------------------------------------------------

    def _touch(self, to: bytes, run_id: str, now: float, timeout_s: float = DEFAULT_RUN_TIMEOUT_S) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            run = self.runs[run_id] = Run(run_id, to, timeout_s, now)
        run.controller, run.last_heard = to, now
        return run

    def _give_up(self, w: Workload, waited_s: float) -> list[Effect]:
        """Report the exit of a workload that SIGKILL did not end, naming its pid, and give the node up:
        its run goes on elsewhere (or fails saying so) instead of waiting for it forever."""
        w.given_up = True
        who = f"task {w.task_id}" if w.task_id else f"rank {w.rank} (attempt {w.attempt})"
        text = (f"pid {w.pid}, {who} of run {w.run_id}, did not die {waited_s:.0f} s after SIGKILL: it is stuck "
                f"in the kernel (an NFS or FUSE read, a GPU fault, a frozen cgroup); node {self.node_id} takes no new "
                "work until it is restarted")
        error = m.WorkerError(kind=FailureKind.UNKILLABLE, message=text, traceback="", phase="node")
        said: list[Effect] = [Warn(text), GiveUpNode(text)]
        return said + self._report_exit(w.run_id, w.attempt, w.rank, w.task_id, w.pid, None, signal.SIGKILL, error,
                                        w.kill_report)

    def _terminate(self, victims: list[Workload], grace_s: float, now: float, reason: str) -> list[Effect]:
        effects: list[Effect] = []
        for w in victims:
            if w.kill_at is None:
                w.kill_at = now + grace_s
                effects.append(Kill(w.pid, signal.SIGTERM, reason))
        return effects

    def _kill_run(self, run: Run, reason: str) -> list[Effect]:
        run.ended = True
        effects: list[Effect] = []
        for w in self.workloads_of(run.run_id):
            w.kill_at = float("inf")
            effects.append(Kill(w.pid, signal.SIGKILL, reason))
        if not effects:
            del self.runs[run.run_id]
        return effects

    def _report_exit(self, run_id: str, attempt: int, rank: int, task_id: str, pid: int, exit_code: int | None,
                     sig: int | None, error: m.WorkerError | None, report: m.KillReport | None) -> list[Effect]:
        run = self.runs.get(run_id)
        if run is None:
            return []
        text = render_report(report) if report is not None else None
        if task_id:
            msg: m.Msg = m.TaskExited(run_id=run_id, task_id=task_id, pid=pid, exit_code=exit_code, signal=sig,
                                      error=error, node_id=self.node_id, kill_report=report, oom_report=text)
        else:
            msg = m.WorkerExited(run_id=run_id, attempt=attempt, rank=rank, pid=pid, exit_code=exit_code, signal=sig,
                                 error=error, node_id=self.node_id, kill_report=report, oom_report=text)
        if run.ended and not self.workloads_of(run_id):
            del self.runs[run_id]
        return [Send(run.controller, msg)]
