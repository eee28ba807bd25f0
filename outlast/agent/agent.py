"""The node agent: one per node, the supervisor of every worker on it.

It owns the fork server (and so learns of a worker's death at once), forwards every
exit to the run's controller, tears attempts down on request (SIGTERM, then SIGKILL
after a grace) and kills a run's workers when its controller falls silent.
One thread, one poll loop: ZeroMQ for controllers and tools, a pipe to the fork server.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
import socket as _socket

import psutil
import zmq

from outlast.agent.membership import HeadRole, MemberLink, UnknownNode
from outlast.agent.memory_guard import MemoryGuard
from outlast.agent.procutil import kill_tree
from outlast.isolation.config import IsolationConfig
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey, start_authenticator
from outlast.protocol.transport import AGENT_REQUESTS, FROM_ZYGOTE, BadMessage, bind_router, encode

log = logging.getLogger("outlast.agent")


@dataclass
class Worker:
    run_id: str
    attempt: int
    rank: int
    pid: int
    kill_at: float | None = None  # SIGKILL deadline once a SIGTERM went out
    task_id: str = ""
    leaf: str | None = None  # its cgroup leaf, with isolation on
    started_at: float = 0.0  # wall clock
    resources: m.Resources = m.Resources()
    retriable: bool = True
    world_size: int = 1
    kill_report: m.KillReport | None = None  # set when outlast killed it for memory
    demand: dict[str, float] = field(default_factory=dict)  # what it holds of the node's resources


@dataclass(frozen=True)
class Placement:
    """What the agent knows of a worker before the fork server reports its pid."""

    leaf: str | None
    resources: m.Resources
    retriable: bool
    world_size: int
    demand: dict[str, float]


@dataclass
class Run:
    run_id: str
    controller: bytes  # the controller's ZeroMQ identity on our socket
    timeout_s: float
    last_heard: float
    stopped_attempts: set[int] = field(default_factory=set)
    ended: bool = False
    last_commit_at: float | None = None  # wall clock, from the controller's heartbeat
    run_key: str = ""


@dataclass(frozen=True)
class NodeSpec:
    """What this node offers the cluster and how it is reached."""

    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)
    failure_domain: str = ""
    node_ip: str = "127.0.0.1"  # where its workers and agent are reached from other nodes
    head_address: str | None = None  # None: this agent is the head
    key: ClusterKey | None = None
    node_timeout_s: float = 5.0


class Agent:
    def __init__(self, node_id: str, host: str, port: int, preload: list[str], clock=time.monotonic,
                 isolation: IsolationConfig | None = None, spec: NodeSpec | None = None) -> None:
        self.node_id = node_id
        self.clock = clock
        self.started_at = time.time()
        self.preload = preload
        self.spec = spec or NodeSpec(resources=default_resources())
        self.ctx = zmq.Context()
        self._auth = start_authenticator(self.ctx, self.spec.key) if self.spec.key is not None else None
        self.sock, bound = bind_router(self.ctx, host, port, key=self.spec.key)
        # Bound to every interface, the agent is reached at the node's own address.
        self.address = bound.replace("0.0.0.0", self.spec.node_ip, 1)
        self.head: HeadRole | None = None
        self.member: MemberLink | None = None
        self.parent_pid: int | None = None  # stop when this process is no longer our parent
        self.runs: dict[str, Run] = {}
        self.workers: dict[int, Worker] = {}
        self.zygote_ready = False
        self.error_dir = tempfile.mkdtemp(prefix=f"outlast-{node_id}-")
        self._stop = False
        self.draining: m.NodeDraining | None = None
        self._graceful_requested = False
        self._notices: queue.SimpleQueue = queue.SimpleQueue()  # from the cloud watchers' threads
        self._watchers: list = []
        self._stop_at: float | None = None
        self._placements: dict[tuple[str, int, int, str], Placement] = {}
        # Before the fork server starts: the agent moves itself into system/, and the server
        # (its child) starts there too.
        self.guard = MemoryGuard.start(isolation, node_id) if isolation and isolation.enable_resource_isolation \
            else None
        try:
            if self.spec.head_address is None:
                self.head = HeadRole(self.spec.node_timeout_s)
                self.head.refresh_self(self.me(), self.clock())
            else:
                self.member = MemberLink(self.ctx, self.spec.head_address, self.spec.key, node_id)
                self.member.join(self.me())
            self._start_zygote()
        except BaseException:
            if self.guard:
                self.guard.close()
            if self.member is not None:
                self.member.close()
            if self._auth is not None:
                self._auth.stop()
            raise

    def me(self) -> m.NodeInfo:
        """This node's entry in the head's table."""
        used: dict[str, dict[str, float]] = {}
        for w in self.workers.values():
            held = used.setdefault(w.run_id, {})
            for k, v in w.demand.items():
                held[k] = held.get(k, 0.0) + v
        return m.NodeInfo(node_id=self.node_id, address=self.address, host=self.spec.node_ip,
                          resources=self.spec.resources, labels=self.spec.labels,
                          failure_domain=self.spec.failure_domain, draining=self.draining, used=used,
                          is_head=self.head is not None)

    # ---- fork server -----------------------------------------------------------

    def _start_zygote(self) -> None:
        ours, theirs = _socket.socketpair()
        self.zygote = subprocess.Popen(
            [sys.executable, "-m", "outlast.agent.zygote", str(theirs.fileno()), ",".join(self.preload)],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.zconn = Connection(ours.detach())

    def _on_zygote_message(self) -> None:
        try:
            data = self.zconn.recv_bytes()
        except (EOFError, OSError):
            log.error("the fork server died (exit %s); stopping the node", self.zygote.poll())
            self._stop = True
            return
        msg = FROM_ZYGOTE.decode(data)
        if isinstance(msg, m.ZygoteReady):
            self.zygote_ready = True
            for name, why in msg.failed.items():
                log.warning("could not preload %s in the fork server: %s", name, why)
        elif isinstance(msg, m.Forked):
            p = self._placements.pop((msg.run_id, msg.attempt, msg.rank, msg.task_id), None)
            self.workers[msg.pid] = Worker(
                msg.run_id, msg.attempt, msg.rank, msg.pid, task_id=msg.task_id, started_at=time.time(),
                leaf=p.leaf if p else None, resources=p.resources if p else m.Resources(),
                retriable=p.retriable if p else True, world_size=p.world_size if p else 1,
                demand=p.demand if p else {})
            run = self.runs.get(msg.run_id)
            if run is None or run.ended or (not msg.task_id and msg.attempt in run.stopped_attempts):
                kill_tree(msg.pid, signal.SIGKILL)  # its attempt was stopped before it was born
                return
            if msg.task_id:
                return
            self._to_controller(run, m.WorkerStarted(run_id=msg.run_id, attempt=msg.attempt, rank=msg.rank,
                                                     pid=msg.pid))
        elif isinstance(msg, m.Reaped):
            w = self.workers.pop(msg.pid, None)
            report = w.kill_report if w else None
            if self.guard is not None:
                self.guard.on_reaped(msg.pid, w.leaf if w else None)
            text = self.guard.render(report) if self.guard is not None and report is not None else None
            run = self.runs.get(msg.run_id)
            if run is not None and msg.task_id:
                self._to_controller(run, m.TaskExited(
                    run_id=msg.run_id, task_id=msg.task_id, pid=msg.pid, exit_code=msg.exit_code,
                    signal=msg.signal, error=msg.error, node_id=self.node_id, kill_report=report, oom_report=text,
                ))
            elif run is not None:
                self._to_controller(run, m.WorkerExited(
                    run_id=msg.run_id, attempt=msg.attempt, rank=msg.rank, pid=msg.pid, exit_code=msg.exit_code,
                    signal=msg.signal, error=msg.error, node_id=self.node_id, kill_report=report, oom_report=text,
                ))
            if run is not None:
                if run.ended and not self._workers_of(run.run_id):
                    del self.runs[run.run_id]

    # ---- requests -------------------------------------------------------------------

    def _on_request(self, identity: bytes, req: m.AgentRequest) -> None:
        now = self.clock()
        if isinstance(req, m.RunHeartbeat):
            run = self.runs.get(req.run_id)
            if run is None:
                run = self.runs[req.run_id] = Run(req.run_id, identity, req.timeout_s, now)
            run.last_heard, run.timeout_s, run.controller = now, req.timeout_s, identity
            run.last_commit_at = req.last_commit_at
            self._reply(identity, self._pong())
        elif isinstance(req, m.SpawnWorkers):
            self._spawn(identity, req, now)
        elif isinstance(req, m.SpawnTask):
            self._spawn_task(identity, req, now)
        elif isinstance(req, m.StopWorkers):
            run = self.runs.get(req.run_id)
            if run is not None:
                run.stopped_attempts.add(req.attempt)
            self._terminate([w for w in self._workers_of(req.run_id) if w.attempt == req.attempt], req.grace_s, now)
        elif isinstance(req, m.EndRun):
            self._end_run(req.run_id, now)
        elif isinstance(req, m.Ping):
            self._reply(identity, self._pong())
        elif isinstance(req, m.StatusRequest):
            self._reply(identity, self.status())
        elif isinstance(req, m.DrainNode):
            self._reply(identity, self._on_drain_request(req))
        elif isinstance(req, m.ListNodes):
            self._reply(identity, m.NodeList(nodes=self._node_table()))
        elif isinstance(req, (m.RegisterNode, m.NodeHeartbeat)):
            if self.head is None:
                log.warning("node %s sent a %s to a member agent; only the head keeps the node table",
                            getattr(req, "node_id", "?"), type(req).__name__)
            elif isinstance(req, m.RegisterNode):
                self._reply(identity, self.head.on_register(identity, req, now))
            else:
                self._reply(identity, self.head.on_heartbeat(identity, req, now))
        elif isinstance(req, m.Shutdown):
            self._stop = True
            self._reply(identity, m.ShutdownAck())

    def watch_cloud_notices(self, kinds: list[str], base_urls: dict[str, str] | None = None) -> None:
        """Drain this node when a cloud says it will take it away (opt-in, by cloud name)."""
        from outlast.drain import detect_watchers

        self._watchers = [w.start() for w in detect_watchers(kinds, self._notices.put, base_urls=base_urls)]

    def _take_notices(self) -> None:
        # The watchers run in their own threads; only this loop touches the sockets.
        while True:
            try:
                notice = self._notices.get_nowait()
            except queue.Empty:
                return
            if self.draining is None:
                left = notice.deadline_unix_s - time.time() if notice.deadline_unix_s is not None else None
                self.drain("preemption", f"{notice.source}: {notice.reason}", None if left is None else max(0.0, left))

    def _pong(self) -> m.Pong:
        return m.Pong(node_id=self.node_id, pid=os.getpid(),
                      head_address=self.spec.head_address if self.member is not None else "")

    def _node_table(self) -> list[m.NodeInfo]:
        if self.head is None:
            return [self.me()]
        self.head.refresh_self(self.me(), self.clock())
        return self.head.table.nodes()

    def _on_drain_request(self, req: m.DrainNode) -> m.DrainAck | m.DrainRefused:
        if self.head is None:
            if req.node_id != self.node_id:
                return m.DrainRefused(reason=f"this agent ({self.node_id}) is a member, not the head; send the "
                                             f"drain to the head at {self.spec.head_address}")
            return self.drain(req.reason, req.message, req.deadline_remaining_s)
        try:
            notice = self.head.drain(req)
        except UnknownNode as e:
            return m.DrainRefused(reason=str(e))
        return m.DrainAck(node_id=req.node_id, runs_notified=self._fan_out_drain(notice), node_ids=notice.node_ids)

    def _fan_out_drain(self, notice: m.NodeDraining) -> int:
        """The head tells every member drained with this notice, and drains itself if listed."""
        assert self.head is not None
        notified = 0
        for node_id in notice.node_ids:
            if node_id == self.node_id:
                notified += self._apply_drain(notice)
            elif node_id in self.head.members:
                self._reply(self.head.members[node_id], notice)
        return notified

    def drain(self, reason: str, message: str, deadline_remaining_s: float | None) -> m.DrainAck:
        """Take no new workers, and tell every run with workers here, so each can save and move."""
        if self.head is not None:  # the head drains the failure domain with it
            notice = self.head.drain(m.DrainNode(node_id=self.node_id, reason=reason, message=message,
                                                 deadline_remaining_s=deadline_remaining_s))
            return m.DrainAck(node_id=self.node_id, runs_notified=self._fan_out_drain(notice),
                              node_ids=notice.node_ids)
        deadline = time.time() + deadline_remaining_s if deadline_remaining_s is not None else None
        notice = m.NodeDraining(node_id=self.node_id, reason=reason, message=message, deadline_unix_s=deadline,
                                node_ids=[self.node_id])
        return m.DrainAck(node_id=self.node_id, runs_notified=self._apply_drain(notice), node_ids=notice.node_ids)

    def _apply_drain(self, notice: m.NodeDraining) -> int:
        """Stop taking workers here; tell every run with workers here. Returns how many runs were told."""
        self.draining = notice
        if self.member is not None:
            self.member.next_heartbeat = 0.0  # the head learns of it on this loop's next turn
        runs = {w.run_id for w in self.workers.values()}
        for run_id in runs:
            if run_id in self.runs:
                self._to_controller(self.runs[run_id], notice)
        left = notice.deadline_unix_s - time.time() if notice.deadline_unix_s is not None else None
        log.warning("node %s is draining (%s: %s, %s); told %d run(s)", self.node_id, notice.reason, notice.message,
                    f"deadline in {left:.0f} s" if left is not None else "no deadline", len(runs))
        return len(runs)

    def _spawn(self, identity: bytes, req: m.SpawnWorkers, now: float) -> None:
        if self.draining is not None:
            self._reply(identity, m.SpawnRefused(run_id=req.run_id, attempt=req.attempt, reason=(
                f"node {self.node_id} is draining ({self.draining.reason}: {self.draining.message})")))
            return
        run = self.runs.get(req.run_id)
        if run is None:
            run = self.runs[req.run_id] = Run(req.run_id, identity, 5.0, now)
        run.controller, run.last_heard = identity, now
        if req.run_key:
            run.run_key = req.run_key
            self._kill_predecessors(run)
        for spec in req.workers:
            procs = self._place((req.run_id, req.attempt, spec.rank, ""), f"{req.run_id}-a{req.attempt}-r{spec.rank}",
                                m.Resources(), True, spec.world_size, dict(req.resources))
            self.zconn.send_bytes(encode(m.ForkWorker(
                run_id=req.run_id, attempt=req.attempt, spec=spec, controller_address=req.controller_address,
                payload=req.payload, env=self._child_env(req.env), cwd=req.cwd, sys_path=req.sys_path,
                run_name=req.run_name,
                restore_checkpoint=req.restore_checkpoint, node_id=self.node_id,
                error_file=os.path.join(self.error_dir, f"{req.run_id}-{req.attempt}-{spec.rank}.json"),
                cgroup_procs=procs,
            )))

    def _spawn_task(self, identity: bytes, req: m.SpawnTask, now: float) -> None:
        run = self.runs.get(req.run_id)
        if run is None:
            run = self.runs[req.run_id] = Run(req.run_id, identity, 5.0, now)
        run.controller, run.last_heard = identity, now
        demand = {"CPU": req.resources.num_cpus}
        if req.resources.memory_bytes:
            demand["memory"] = float(req.resources.memory_bytes)
        procs = self._place((req.run_id, 0, -1, req.task_id), f"task-{req.task_id}", req.resources,
                            req.retriable, 1, demand)
        self.zconn.send_bytes(encode(m.ForkTask(
            run_id=req.run_id, task_id=req.task_id, controller_address=req.controller_address, payload=req.payload,
            env=self._child_env(req.env), cwd=req.cwd, sys_path=req.sys_path, node_id=self.node_id,
            error_file=os.path.join(self.error_dir, f"task-{req.task_id}.json"), cgroup_procs=procs,
        )))

    def _place(self, key: tuple[str, int, int, str], leaf: str, resources: m.Resources, retriable: bool,
               world_size: int, demand: dict[str, float]) -> list[str]:
        """Create the worker's cgroup leaf (with isolation on); the child moves itself in."""
        procs: list[str] = []
        if self.guard is not None:
            try:
                procs = self.guard.create_leaf(leaf, resources)
            except OSError as e:
                # Better a worker outside its leaf (charged to the system) than a node that stops.
                log.error("could not create the cgroup leaf %s (%s); the worker runs without one", leaf, e)
                leaf = None
        self._placements[key] = Placement(leaf if procs else None, resources, retriable, world_size, demand)
        return procs

    def _child_env(self, env: dict[str, str]) -> dict[str, str]:
        # A worker talks to its controller with the cluster key, like everyone else.
        return {**env, **self.spec.key.env} if self.spec.key is not None else env

    def _kill_predecessors(self, run: Run) -> None:
        """A driver relaunched on the same run holds its lease now: its predecessor is dead, so
        that one's workers go at once instead of after the heartbeat timeout."""
        for old in list(self.runs.values()):
            if old is run or old.run_key != run.run_key or old.ended:
                continue
            log.warning("run %s was relaunched by a new driver; killing the old driver's workers", run.run_key)
            old.ended = True
            for w in self._workers_of(old.run_id):
                kill_tree(w.pid, signal.SIGKILL)
                w.kill_at = float("inf")

    def _end_run(self, run_id: str, now: float) -> None:
        run = self.runs.get(run_id)
        if run is None:
            return
        run.ended = True
        workers = self._workers_of(run_id)
        if workers:
            self._terminate(workers, 1.0, now)
        else:
            del self.runs[run_id]

    def _terminate(self, workers: list[Worker], grace_s: float, now: float) -> None:
        for w in workers:
            if w.kill_at is None:
                kill_tree(w.pid, signal.SIGTERM)
                w.kill_at = now + grace_s

    def _workers_of(self, run_id: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.run_id == run_id]

    # ---- timers ------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.warning("the process that started this node (pid %d) is gone; stopping", self.parent_pid)
            self._stop = True
        self._take_notices()
        if self.head is not None:
            self.head.expire(now)
        if self.member is not None:
            for order in self.member.receive():
                if isinstance(order, m.NodeDraining) and self.draining is None:
                    self._apply_drain(order)
            self.member.heartbeat_if_due(now, self.me())
        if self.guard is not None:
            self.guard.on_tick(now, self)
        for w in self.workers.values():
            if w.kill_at is not None and now >= w.kill_at:
                kill_tree(w.pid, signal.SIGKILL)
                w.kill_at = float("inf")
        for run in list(self.runs.values()):
            if not run.ended and now - run.last_heard > run.timeout_s:
                log.warning("run %s: no heartbeat from its driver for %.1f s; killing its workers",
                            run.run_id, now - run.last_heard)
                run.ended = True
                for w in self._workers_of(run.run_id):
                    kill_tree(w.pid, signal.SIGKILL)
                    w.kill_at = float("inf")
                if not self._workers_of(run.run_id):
                    del self.runs[run.run_id]

    # ---- status ---------------------------------------------------------------------------

    def status(self) -> m.StatusReply:
        infos = []
        for w in self.workers.values():
            try:
                rss = psutil.Process(w.pid).memory_info().rss
            except psutil.Error:
                rss = 0
            mem = self.guard.leaf_memory(w.leaf) if self.guard is not None and w.leaf else 0
            infos.append(m.WorkerInfo(run_id=w.run_id, attempt=w.attempt, rank=w.rank, pid=w.pid, rss_bytes=rss,
                                      task_id=w.task_id, memory_bytes=mem, resources=w.resources))
        g = self.guard
        return m.StatusReply(
            node_id=self.node_id, pid=os.getpid(), address=self.address, started_at=self.started_at,
            runs=sorted(self.runs), workers=infos, preload=self.preload, zygote_ready=self.zygote_ready,
            draining=self.draining,
            isolation=g.info() if g else None, recent_kills=g.recent_kills() if g else [],
            capacity=g.capacity() if g else m.Resources(num_cpus=self.spec.resources.get("CPU", 0.0),
                                                         memory_bytes=int(self.spec.resources.get("memory", 0))),
            head_address=self.spec.head_address if self.member is not None else "",
            nodes=self._node_table() if self.head is not None else [],
            run_commits={r.run_id: r.last_commit_at for r in self.runs.values() if r.last_commit_at is not None},
        )

    # ---- loop ------------------------------------------------------------------------------

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.zconn.fileno(), zmq.POLLIN)
        if self.member is not None:
            poller.register(self.member.sock, zmq.POLLIN)
        sources = self.guard.sources_by_fd() if self.guard is not None else {}
        for fd in sources:
            poller.register(fd, zmq.POLLIN)
        while not self._stop:
            for item, _ in poller.poll(timeout=100):
                if item is self.sock:
                    self._drain_requests()
                elif self.member is not None and item is self.member.sock:
                    pass  # drain orders from the head: taken in _tick, right below
                elif item in sources:
                    self.guard.on_event(sources[item], self)
                else:
                    self._on_zygote_message()
            if self.guard is not None and self.guard.sources_by_fd() != sources:
                for fd in sources:
                    poller.unregister(fd)
                sources = self.guard.sources_by_fd()
                for fd in sources:
                    poller.register(fd, zmq.POLLIN)
            self._tick(self.clock())
            self._graceful_step(self.clock())
        self.close()

    def request_stop(self, *_args) -> None:
        self._stop = True

    def request_graceful_stop(self, *_args) -> None:
        """SIGTERM: drain with a deadline, then stop (a signal handler only sets a flag)."""
        self._graceful_requested = True

    def _graceful_step(self, now: float) -> None:
        if self._graceful_requested and self._stop_at is None:
            timeout = float(os.environ.get("OUTLAST_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "30"))
            if self.draining is None:
                self.drain("shutdown", "the node agent received SIGTERM", timeout)
            self._stop_at = now + timeout
        if self._stop_at is not None and (now >= self._stop_at or not self.workers):
            self._stop = True

    def _drain_requests(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._on_request(frames[0], AGENT_REQUESTS.decode(frames[-1]))
            except BadMessage as e:
                log.warning("dropped a malformed request: %s", e)

    def _reply(self, identity: bytes, msg: m.Msg) -> None:
        self.sock.send_multipart([identity, encode(msg)])

    def _to_controller(self, run: Run, msg: m.Msg) -> None:
        self._reply(run.controller, msg)

    def close(self) -> None:
        for watcher in self._watchers:
            watcher.stop()
        for w in list(self.workers.values()):
            kill_tree(w.pid, signal.SIGKILL)
            if self.guard is not None and w.leaf:
                self.guard.kill_leaf(w.leaf)  # the whole leaf: a worker's children too
        self.zconn.close()  # the fork server exits on EOF
        try:
            self.zygote.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.zygote.kill()
        if self.guard is not None:
            self.guard.close()  # undo every cgroup write, in reverse order
        self.sock.close(linger=500)
        if self.member is not None:
            self.member.close()
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
        try:
            os.rmdir(self.error_dir)
        except OSError:
            pass


def default_resources() -> dict[str, float]:
    """What a node offers when not told: its usable cores and its memory, no GPU."""
    return {"CPU": float(len(os.sched_getaffinity(0))), "GPU": 0.0, "memory": float(psutil.virtual_memory().total)}
