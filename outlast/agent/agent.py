"""The node agent: one per node, the supervisor of every workload on it.

This module is the dispatcher: one thread, one poll loop over the agent's socket
(controllers, tools, member nodes), the pipe to the fork server, the head link of a
member, and the memory monitors. Each input goes to the part that decides
(`node_core.NodeCore` for runs, their workloads and drains, the node role for the
cluster, the memory guard for memory), and the effects that come back are carried out
here. The simulator drives the same `NodeCore`.
The processes and protocols are described in docs/architecture.md.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import psutil
import zmq

from outlast.agent import workdir
from outlast.agent.drain_sources import DrainSources
from outlast.agent.etcd_role import EtcdNode
from outlast.agent.forkserver import ForkServer
from outlast.agent.worker_user import WorkerUser
from outlast.client.restarts import GiveUp
from outlast.agent.memory_guard import MemoryGuard, Victim
from outlast.agent.output import OutputTails, read_output
from outlast.agent.roles import HeadNode, MemberNode, NodeRole
from outlast.agent.status import node_status
from outlast.agent.tier_server import TierServer, start_tier
from outlast.agent.gpus import dev_names, node_gpu_ids
from outlast.agent.node_core import FinishOutput, Fork, NodeCore, NodeEffect
from outlast.agent.supervisor import UNKILLABLE_AFTER_S, GiveUpNode, Kill, ReleaseLeaf, Send, Warn
from outlast.client.liveness import host_id
from outlast.cluster.etcd_store import EtcdConfig
from outlast.isolation.config import IsolationConfig
from outlast.isolation.reservations import Reservations, default_checkpoint_memory
from outlast.procutil import kill_tree
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey, start_authenticator
from outlast.protocol.transport import AGENT_REQUESTS, BadMessage, VersionMismatch, bind_router, encode, receive_all
from outlast.statedir import private_subdir

if TYPE_CHECKING:
    from outlast.agent.metrics import NodeMetrics

log = logging.getLogger("outlast.agent")


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
    etcd: EtcdConfig | None = None  # the cluster lives in etcd: no head process, the head role elected
    checkpoint_memory: int | None = None  # the memory tier's budget; 0: no tier; None: fitted to the node
    embedded: bool = False  # its node id dies with it, and so does its memory tier
    worker_user: WorkerUser | None = None  # workers drop to this user (outlast/agent/worker_user.py)


def tier_budget(given: int | None, reserved: Reservations | None, machine_memory: int) -> int:
    """The memory tier's budget: with isolation, the one reserved for it; else as given, or fitted to the machine."""
    if reserved is not None:
        return reserved.checkpoint_memory
    return default_checkpoint_memory(machine_memory) if given is None else given


class Agent:
    def __init__(self, node_id: str, host: str, port: int, preload: list[str],
                 clock: Callable[[], float] = time.monotonic,
                 isolation: IsolationConfig | None = None, spec: NodeSpec | None = None,
                 forks: ForkServer | None = None) -> None:
        """`forks`: a fork server started ahead (a standby agent's: outlast/agent/__main__.py), else one is started."""
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
        self.core = NodeCore(node_id, os.getpid(),
                             node_gpu_ids(self.spec.resources.get("GPU", 0.0), os.environ, dev_names()),
                             unkillable_after_s=float(os.environ.get("OUTLAST_UNKILLABLE_TIMEOUT_S",
                                                                     UNKILLABLE_AFTER_S)),
                             cpus=self.spec.resources.get("CPU", 1.0))
        self.fork_server_ready: m.ZygoteReady | None = None  # what the fork server said once ready
        self.sup = self.core.sup
        self.tier: TierServer | None = None
        self.parent_pid: int | None = None  # stop when this process is no longer our parent
        self.workdir = workdir.claim(node_id)  # after removing what agents that are gone left
        self.output = OutputTails(node_id, private_subdir("logs"))
        self.metrics: NodeMetrics | None = None  # once __main__ serves them
        self._stop = False
        self.sources = DrainSources()
        self._poller = zmq.Poller()
        # Before the fork server starts: the agent moves itself into system/, and the server
        # (its child) starts there too.
        self.guard = MemoryGuard.start(replace(isolation, checkpoint_memory=self.spec.checkpoint_memory), node_id) \
            if isolation and isolation.enable_resource_isolation else None
        role: NodeRole | None = None
        try:
            budget = tier_budget(self.spec.checkpoint_memory, self.guard.iso.reservations if self.guard else None,
                                 psutil.virtual_memory().total)
            self.tier = start_tier(self.ctx, self.spec.key, node_id, host, budget,
                                   fitted=self.spec.checkpoint_memory is None,
                                   source_owner=self.spec.worker_user.uid if self.spec.worker_user else None)
            self.role = role = self._role()
            role.join(self.me())
            self.forks = forks or ForkServer(preload, self.spec.worker_user)
        except BaseException:
            if forks is not None:
                forks.close()
            workdir.release(self.workdir)
            if self.guard:
                self.guard.close()
            if role is not None:
                role.close()
            if self.tier is not None:
                self.tier.stop()
            if self._auth is not None:
                self._auth.stop()
            raise

    def _role(self) -> NodeRole:
        """The node's place in the cluster, as its spec says: the head, a member of one, or a node of etcd's."""
        if self.spec.etcd is None:
            if self.spec.head_address is None:
                return HeadNode(self.node_id, self.spec.node_timeout_s)
            return MemberNode(self.ctx, self.spec.head_address, self.spec.key, self.node_id)
        if self.spec.key is None:
            raise ValueError("a cluster kept in etcd needs the cluster key, which seals what it writes there: give "
                             "--cluster-key (or OUTLAST_CLUSTER_KEY) with --etcd")
        return EtcdNode(self.spec.etcd, self.spec.key, self.node_id)

    def me(self) -> m.NodeInfo:
        """This node's entry in the head's table."""
        return m.NodeInfo(node_id=self.node_id, address=self.address, host=self.spec.node_ip,
                          resources=self.spec.resources, labels=self.spec.labels,
                          failure_domain=self.spec.failure_domain, draining=self.draining, used=self.sup.usage(),
                          is_head=self.role.is_head, agent_pid=os.getpid(),
                          host_id=host_id(),
                          tier_address=self.tier.address.replace("0.0.0.0", self.spec.node_ip, 1) if self.tier else "")

    @property
    def draining(self) -> m.NodeDraining | None:
        return self.core.draining

    # ---- effects ---------------------------------------------------------------------------------

    def apply(self, effects: Sequence[NodeEffect]) -> None:
        for e in effects:
            if isinstance(e, Fork):
                self._fork(e)
            elif isinstance(e, FinishOutput):
                lines = self.output.finish_run(e.run_id) if e.key is None else self.output.finish(*e.key)
                if e.to is not None:
                    for msg in lines:
                        self._reply(e.to, msg)
            elif isinstance(e, Send):
                self._reply(e.to, e.msg)
            elif isinstance(e, Kill):
                if e.pid > 0:  # never 0 or -1: those name our own group or everyone
                    kill_tree(e.pid, e.sig)
            elif isinstance(e, ReleaseLeaf):
                if self.guard is not None:
                    self.guard.on_reaped(e.pid, e.leaf)
            elif isinstance(e, Warn):
                log.warning("%s", e.text)
            elif isinstance(e, GiveUpNode):
                if self.draining is None:
                    self.drain("other", e.reason, None)

    # ---- fork server --------------------------------------------------------------------------

    def _on_fork_server(self, fd: int) -> None:
        if fd != self.forks.fileno():
            if (line := self.forks.on_standby()) is not None:
                log.warning("%s", line)
            return
        msg = self.forks.receive()
        if msg is None:
            self._fork_server_died()
        elif isinstance(msg, m.ZygoteReady):
            self.fork_server_ready = msg
            for name, why in msg.failed.items():
                log.warning("could not preload %s in the fork server: %s", name, why)
            if msg.cuda_initialized:
                log.error("the fork server initialized CUDA while preloading %s (%s): workers forked from it "
                          "cannot use a GPU; remove the module that does it from OUTLAST_PRELOAD (or --preload)",
                          ",".join(msg.preloaded), msg.cuda_initialized)
        elif isinstance(msg, (m.Forked, m.Reaped)):
            self.apply(self.core.on_fork_server(msg, time.time()))

    def _fork_server_died(self) -> None:
        """Its workloads died with it: report them lost (their runs restart them), then start a new
        one (it imports the preloaded modules again), later if it keeps dying, or stop the node."""
        pid = self.forks.pid
        how, decision = self.forks.died(self.clock())
        self.core.gpus.release_all()
        self.apply(self.sup.lose_all(f"the fork server of node {self.node_id} (pid {pid}) died ({how}); "
                                     "its workers died with it"))
        if isinstance(decision, GiveUp):
            log.error("%s; stopping the node", decision.reason)
            self._stop = True
        else:
            log.warning("%s", decision.reason)

    # ---- requests -------------------------------------------------------------------------------

    def _on_request(self, identity: bytes, req: m.AgentRequest) -> None:
        now = self.clock()
        effects = self.core.on_request(identity, req, now, self.role.head_address)
        if effects is not None:
            self.apply(effects)
        elif isinstance(req, m.StatusRequest):
            self._reply(identity, self.status())
        elif isinstance(req, m.DrainNode):
            self._reply(identity, self.role.drain(req, self._apply_drain, self._reply))
        elif isinstance(req, m.ReadOutput):
            self._reply(identity, read_output(self.output.log_dir, req))
        elif isinstance(req, m.ListNodes):
            self._reply(identity, m.NodeList(nodes=self.role.nodes(self.me(), now)))
        elif isinstance(req, (m.RegisterNode, m.NodeHeartbeat)):
            answer = self.role.on_peer(identity, req, now)
            if answer is not None:
                self._reply(identity, answer)
        elif isinstance(req, m.Shutdown):
            self._stop = True
            self._reply(identity, m.ShutdownAck())

    def _fork(self, f: Fork) -> None:
        procs = self._place(f)
        if f.task is not None:
            task = f.task
            error_file = os.path.join(self.workdir, f"task-{task.task_id}.json")
            self.forks.send(
                m.ForkChild(kind="task", run_id=task.run_id, task_id=task.task_id, error_file=error_file,
                            cgroup_procs=procs, output_file=self.output.file_for_task(task)),
                m.ForkTask(run_id=task.run_id, task_id=task.task_id, controller_address=task.controller_address,
                           payload=task.payload, env=task.env, cwd=task.cwd, sys_path=task.sys_path,
                           node_id=self.node_id, error_file=error_file, threads=f.threads))
            return
        req, spec = f.spawn, f.spec
        assert req is not None and spec is not None
        error_file = os.path.join(self.workdir, f"{req.run_id}-{req.attempt}-{spec.rank}.json")
        self.forks.send(
            m.ForkChild(kind="worker", run_id=req.run_id, attempt=req.attempt, rank=spec.rank, error_file=error_file,
                        cgroup_procs=procs, output_file=self.output.file_for(req, spec.rank)),
            # The run's own credential is in its env: a worker never holds the cluster key.
            m.ForkWorker(run_id=req.run_id, attempt=req.attempt, spec=spec, controller_address=req.controller_address,
                         payload=req.payload, env=f.env if f.env is not None else req.env, cwd=req.cwd,
                         sys_path=req.sys_path, run_name=req.run_name, restore_checkpoint=req.restore_checkpoint,
                         node_id=self.node_id, error_file=error_file, threads=f.threads))

    def _place(self, f: Fork) -> list[str]:
        """Create the workload's cgroup leaf (with isolation on); the child moves itself in."""
        procs: list[str] = []
        if self.guard is not None:
            try:
                procs = self.guard.create_leaf(f.leaf, f.placement.resources)
            except OSError as e:
                # Better a worker outside its leaf (charged to the system) than a node that stops.
                log.error("could not create the cgroup leaf %s (%s); the worker runs without one", f.leaf, e)
        if procs:
            self.sup.expect(f.key, replace(f.placement, leaf=f.leaf))
        return procs

    def _send_output(self, msgs: list[m.WorkerOutput]) -> None:
        for msg in msgs:
            run = self.sup.runs.get(msg.run_id)
            if run is not None:
                self._reply(run.controller, msg)

    # ---- drains ---------------------------------------------------------------------------------

    def watch_cloud_notices(self, kinds: list[str], base_urls: dict[str, str] | None = None) -> None:
        """Drain this node when a cloud says it will take it away (opt-in, by cloud name)."""
        self.sources.watch_clouds(kinds, base_urls)

    def drain(self, reason: str, message: str, deadline_remaining_s: float | None) -> m.DrainAck | m.DrainRefused:
        """Take no new workers, and tell every run with workers here, so each can save and move.
        On the head, the node's failure domain drains with it."""
        return self.role.drain(m.DrainNode(node_id=self.node_id, reason=reason, message=message,
                                           deadline_remaining_s=deadline_remaining_s), self._apply_drain, self._reply)

    def _apply_drain(self, notice: m.NodeDraining) -> int:
        """Stop taking workers here; tell every run with workers here. Returns how many runs were told."""
        told = self.core.drain(notice)
        self.role.drained_here()
        if self.tier is not None:
            self.tier.drain(notice.deadline_unix_s)
        self.apply(told)
        left = notice.deadline_unix_s - time.time() if notice.deadline_unix_s is not None else None
        log.warning("node %s is draining (%s: %s, %s); told %d run(s)", self.node_id, notice.reason, notice.message,
                    f"deadline in {left:.0f} s" if left is not None else "no deadline", len(told))
        return len(told)

    # ---- timers ----------------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.warning("the process that started this node (pid %d) is gone; stopping", self.parent_pid)
            self._stop = True
        for order in self.sources.take(now):
            if self.draining is None:
                self.drain(order.reason, order.message, order.deadline_remaining_s)
        if self.sources.stop_at is not None and (now >= self.sources.stop_at or not self.sup.workloads):
            self._stop = True  # after a SIGTERM: drained, or out of time
        for notice in self.role.tick(self.me(), now):
            if self.draining is None:
                self._apply_drain(notice)
        if self.guard is not None:
            self._oom_kill(self.guard.on_tick(now, self.sup.memory_view()))
        if self.tier is not None:
            self.tier.watch()  # a thread of the tier that died is started again, and the log says why
        self.apply(self.sup.tick(now))
        if self.metrics is not None:
            self.metrics.refresh(now, self.sup.workloads.values(), self.forks.ready, self.guard,
                                 self.output.skipped_lines)

    def _oom_kill(self, victims: list[Victim]) -> None:
        for v in victims:
            if self.metrics is not None:
                self.metrics.on_kill(v.report)
            self.apply(self.sup.oom_kill(v.pid, v.report))

    # ---- status ---------------------------------------------------------------------------------

    def status(self) -> m.StatusReply:
        return node_status(self)

    # ---- loop ----------------------------------------------------------------------------------

    def serve(self) -> None:
        poller = self._poller
        poller.register(self.sock, zmq.POLLIN)
        servers = self._poll_fork_servers(set())
        if self.role.sock is not None:
            poller.register(self.role.sock, zmq.POLLIN)  # drain orders from the head: taken in _tick
        sources = self.guard.sources_by_fd() if self.guard is not None else {}
        for fd in sources:
            poller.register(fd, zmq.POLLIN)
        while not self._stop:
            for item, _ in poller.poll(timeout=100):
                if item is self.sock:
                    self._read_requests()
                elif item in sources and self.guard is not None:
                    self._oom_kill(self.guard.on_event(sources[item], self.sup.memory_view()))
                elif item in servers and item in self.forks.fds():
                    self._on_fork_server(item)
                    servers = self._poll_fork_servers(servers)
            self._send_output(self.output.read_all())
            if self.guard is not None and self.guard.sources_by_fd() != sources:
                for fd in sources:
                    poller.unregister(fd)
                sources = self.guard.sources_by_fd()
                for fd in sources:
                    poller.register(fd, zmq.POLLIN)
            started = self.forks.restart_if_due(self.clock())
            if started is not None:
                servers = self._poll_fork_servers(servers)
                log.info("%s", started)
            self._tick(self.clock())
        self.close()

    def _poll_fork_servers(self, polled: set[int]) -> set[int]:
        """Poll the pipes of the fork server and its standby, as they are now."""
        now = self.forks.fds()
        for fd in polled - now:
            try:
                self._poller.unregister(fd)
            except KeyError:
                pass
        for fd in now - polled:
            self._poller.register(fd, zmq.POLLIN)
        return now

    def request_stop(self, *_args: object) -> None:
        self._stop = True

    def request_graceful_stop(self, *_args: object) -> None:
        """SIGTERM: drain with a deadline, then stop (a signal handler only sets a flag)."""
        self.sources.request_graceful_stop()

    def _read_requests(self) -> None:
        def refuse(frames: list[bytes], e: BadMessage) -> bool:
            if isinstance(e, VersionMismatch):  # answered in our header, which says our version
                log.warning("refused a request: %s", e)
                self._reply(frames[0], m.Pong(node_id=self.node_id, pid=os.getpid()))
            return isinstance(e, VersionMismatch)

        for frames, req in receive_all(self.sock, AGENT_REQUESTS, "request", on_bad=refuse):
            try:
                self._on_request(frames[0], req)
            except Exception as e:  # noqa: BLE001 - one request's failure (an OSError: a full disk) is its own
                log.exception("node %s failed on a %s", self.node_id, type(req).__name__)
                answer = failed_answer(self.node_id, req, e)
                if answer is not None:
                    self._reply(frames[0], answer)

    def _reply(self, identity: bytes, msg: m.Msg) -> None:
        self.sock.send_multipart([identity, encode(msg)])

    def close(self) -> None:
        self.sources.close()
        for w in list(self.sup.workloads.values()):
            kill_tree(w.pid, signal.SIGKILL)
            if self.guard is not None and w.leaf:
                self.guard.kill_leaf(w.leaf)  # the whole leaf: a worker's children too
        self.forks.close()
        self.output.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.guard is not None:
            self.guard.close()  # undo every cgroup write, in reverse order
        self.sock.close(linger=500)
        if self.tier is not None:
            self.tier.stop()
            self.tier.store.close(free=self.spec.embedded)
        self.role.close()
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
        workdir.release(self.workdir)


def failed_answer(node_id: str, req: m.AgentRequest, e: Exception) -> m.Msg | None:
    """The answer to a request that raised, where its answer can carry an error. The others' askers time out,
    as for a node that does not answer: a spawn may have forked some of its workers before it failed, so it
    is not refused (which would say that nothing started)."""
    why = f"node {node_id} failed on a {type(req).__name__}: {type(e).__name__}: {e}"
    if isinstance(req, m.DrainNode):
        return m.DrainRefused(reason=why)
    if isinstance(req, m.ReadOutput):
        return m.OutputLines(path=req.path, lines=[], error=why)
    return None


def default_resources() -> dict[str, float]:
    """What a node offers when not told: its usable cores, its memory, the GPUs it sees (gpus.py)."""
    return {"CPU": float(len(os.sched_getaffinity(0))), "GPU": float(len(node_gpu_ids(None, os.environ, dev_names()))),
            "memory": float(psutil.virtual_memory().total)}
