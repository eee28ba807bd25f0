"""`outlast slurm -- CMD`: the job's nodes become an outlast cluster, CMD its driver (effects).

Run from the batch script (`exec outlast slurm -- python train.py`, so that the script's
signals reach it). It starts one agent per node of the allocation with `srun` (the head on the
batch host, the others joining it with a key made for this job and kept in a private
directory), waits until every node has joined, runs CMD with the cluster in its environment,
and watches: Slurm's signals and node states become drains (`policy.py`), a drained job is
requeued once its checkpoint is committed, and everything it started stops when CMD ends or
the job is cancelled.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from outlast.client.discovery import AgentUnavailable, NodeFile, request
from outlast.cluster.etcd_store import EtcdConfig
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.slurm import policy
from outlast.slurm.allocation import Allocation
from outlast.slurm.commands import Slurm, SlurmCommandError
from outlast.slurm.policy import DrainOrder

log = logging.getLogger("outlast.slurm")


@dataclass
class Options:
    command: list[str]
    failure_domain_feature: str = ""  # a node's feature with this prefix is its failure domain
    failure_domain_switch: bool = False  # a node's leaf switch in Slurm's topology is its failure domain
    preload: str = ""
    join_timeout_s: float = 180.0
    poll_interval_s: float = 1.0  # `scontrol show node`, for administrators' drains
    requeue_margin_s: float = 3.0  # requeue this long before Slurm's deadline, committed or not
    etcd: EtcdConfig | None = None  # keep the cluster in etcd: every agent joins it, the head role is elected
    history_grace_s: float = 3.0  # for the driver to record the preempted attempt before it is stopped


@dataclass
class Draining:
    """Drains sent, waiting for the checkpoint they ask for, then a requeue."""

    since: float  # wall clock when the first drain went out
    node_ids: set[str]
    deadline: float | None  # wall clock; None: Slurm named none
    why: str
    had_workers: bool  # the run had workers on the job's nodes when the drain went out
    idle_since: float | None = None  # since when no node has had workers


@dataclass
class Job:
    alloc: Allocation
    slurm: Slurm
    options: Options
    private: Path
    key: ClusterKey
    ctx: zmq.Context = field(default_factory=zmq.Context)
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)
    head_address: str = ""
    driver: subprocess.Popen | None = None
    signals: list[signal.Signals] = field(default_factory=list)
    drained_by_slurm: set[str] = field(default_factory=set)
    draining: Draining | None = None
    next_node_poll: float = 0.0
    requeue_at_exit: bool = False

    # ---- start -----------------------------------------------------------------------------

    def start_agents(self) -> None:
        states = {s.name: s for s in self.slurm.show_nodes(self.alloc.nodes)}
        switches = self.slurm.leaf_switches() if self.options.failure_domain_switch else {}
        secret = {**self.key.env, **(self.options.etcd.env() if self.options.etcd else {})}
        first, rest = self.alloc.nodes[0], self.alloc.nodes[1:]
        # A start before a requeue may have been killed before its agents removed their node files:
        # the head's address must be the one its new agent writes.
        (self.private / first / "node.json").unlink(missing_ok=True)
        self.agents[first] = self.slurm.srun_on(first, self._node_argv(first, states, switches, ""), secret)
        self.head_address = self._wait_head_address()
        log.info("head agent on %s at %s", first, self.head_address)
        for node in rest:
            self.agents[node] = self.slurm.srun_on(node, self._node_argv(node, states, switches, self.head_address),
                                                   secret)

    def _node_argv(self, node: str, states, switches: dict[str, str], head: str) -> list[str]:
        state = states.get(node)
        addr = socket.gethostbyname(state.addr if state is not None and state.addr else node)
        domain = switches.get(node) or policy.failure_domain(state.features if state else [],
                                                             self.options.failure_domain_feature)
        argv = [sys.executable, "-m", "outlast.slurm.node", "--node-id", node, "--host", addr,
                "--num-cpus", str(self.alloc.cpus[node]), "--home", str(self.private / node),
                "--preload", self.options.preload, "--labels", f"slurm_job={self.alloc.job_id}"]
        if head and self.options.etcd is None:
            argv += ["--address", head]
        if domain:
            argv += ["--failure-domain", domain]
        return argv

    def _wait_head_address(self) -> str:
        node_file = self.private / self.alloc.nodes[0] / "node.json"  # the head publishes its address there
        deadline = time.monotonic() + self.options.join_timeout_s
        while time.monotonic() < deadline:
            try:
                return msgspec.json.decode(node_file.read_bytes(), type=NodeFile).address
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                pass  # not there yet, or half written
            if self.agents[self.alloc.nodes[0]].poll() is not None:
                raise RuntimeError(f"the head agent's step on {self.alloc.nodes[0]} exited with code "
                                   f"{self.agents[self.alloc.nodes[0]].returncode}; its output is above")
            time.sleep(0.05)
        raise RuntimeError(f"the head agent on {self.alloc.nodes[0]} did not listen within "
                           f"{self.options.join_timeout_s:.0f} s")

    def wait_joined(self) -> None:
        deadline = time.monotonic() + self.options.join_timeout_s
        want = set(self.alloc.nodes)
        while True:
            joined = {n.node_id for n in self._node_table() if n.state == "alive"}
            if want <= joined:
                log.info("all %d nodes joined: %s", len(want), ", ".join(self.alloc.nodes))
                return
            failed = [n for n, p in self.agents.items() if p.poll() is not None]
            if failed or time.monotonic() > deadline:
                why = f"the agent steps on {', '.join(failed)} exited" if failed else \
                    f"waited {self.options.join_timeout_s:.0f} s"
                raise RuntimeError(f"nodes {', '.join(sorted(want - joined))} did not join the head at "
                                   f"{self.head_address} ({why}); their output is above")
            time.sleep(0.1)

    def start_driver(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "OUTLAST_CLUSTER_SECRET"}
        env.update(OUTLAST_ADDRESS=self.head_address, OUTLAST_CLUSTER_KEY=str(self.private / "cluster.key"),
                   OUTLAST_HOME=str(self.private / "driver"))
        env.update(self.options.etcd.env() if self.options.etcd else {})  # the driver watches etcd itself
        # Its own session: Slurm's signals come to this process, which decides what the driver hears.
        self.driver = subprocess.Popen(self.options.command, env=env, start_new_session=True)
        log.info("driver started (pid %d): %s", self.driver.pid, " ".join(self.options.command))

    # ---- watch -----------------------------------------------------------------------------

    def supervise(self) -> int:
        assert self.driver is not None
        while True:
            code = self.driver.poll()
            if code is not None:
                log.info("the driver exited with code %d", code)
                return code
            while self.signals:
                sig = self.signals.pop(0)
                if sig is not signal.SIGUSR1:
                    log.warning("got %s: not a preemption; stopping without a requeue", sig.name)
                    return 128 + sig
                self._preempted(sig)
            now = time.time()
            if time.monotonic() >= self.next_node_poll:
                self.next_node_poll = time.monotonic() + self.options.poll_interval_s
                self._poll_nodes(now)
            if self.draining is not None and self._ready_to_requeue(now):
                return self._requeue()
            head = self.agents[self.alloc.nodes[0]]
            if head.poll() is not None:
                log.error("the head agent's step on %s ended (code %s): the cluster is gone", self.alloc.nodes[0],
                          head.returncode)
                return 1
            time.sleep(0.1)

    def _preempted(self, sig: signal.Signals) -> None:
        log.warning("got %s from Slurm: draining every node of the job", sig.name)
        try:
            job = self.slurm.show_job(self.alloc.job_id)
            grace = self.slurm.grace_s(job.partition) if job.preempt_time is not None else 0.0
        except (SlurmCommandError, ValueError) as e:
            log.error("%s; draining with no deadline", e)
            job, grace = None, 0.0
        if job is None:
            order = DrainOrder(node_ids=self.alloc.nodes, reason="preemption", deadline_s=None, requeue=True,
                               message=f"Slurm job {self.alloc.job_id} (restart {self.alloc.restart_count}) got "
                                       f"{sig.name}")
        else:
            order = policy.on_signal(sig, job, grace, self.alloc.nodes, self.alloc.restart_count, time.time())
        if order is not None:
            self._drain(order)

    def _poll_nodes(self, now: float) -> None:
        try:
            states = self.slurm.show_nodes(self.alloc.nodes)
        except SlurmCommandError as e:
            log.warning("%s; trying again", e)
            return
        for order in policy.on_node_states(states, self.alloc.nodes, self.drained_by_slurm, self.alloc.job_id,
                                           self.alloc.restart_count, now):
            self.drained_by_slurm.update(order.node_ids)
            self._drain(order)

    def _drain(self, order: DrainOrder) -> None:
        now = time.time()
        had_workers = self.draining.had_workers if self.draining else self._workers_running()
        first, *also = order.node_ids
        try:  # one drain of every node: the run hears one notice naming them all
            reply = request(self.ctx, self.head_address, m.DrainNode(
                node_id=first, also=also, reason=order.reason, message=order.message,
                deadline_remaining_s=order.deadline_s, until_commit=order.requeue), timeout_s=5.0, key=self.key)
            if isinstance(reply, m.DrainRefused):
                log.error("the head refused to drain %s: %s", ", ".join(order.node_ids), reply.reason)
        except AgentUnavailable as e:
            log.error("could not drain %s: %s", ", ".join(order.node_ids), e)
        deadline = now + order.deadline_s if order.deadline_s is not None else None
        log.warning("drained %s (%s; deadline %s)", ", ".join(order.node_ids), order.message,
                    f"in {order.deadline_s:.1f} s" if order.deadline_s is not None else "none")
        if self.draining is None:
            self.draining = Draining(since=now, node_ids=set(order.node_ids), deadline=deadline, why=order.message,
                                     had_workers=had_workers)
        else:
            self.draining.node_ids |= set(order.node_ids)
            if deadline is not None:
                self.draining.deadline = min(d for d in (deadline, self.draining.deadline) if d is not None)

    def _ready_to_requeue(self, now: float) -> bool:
        d = self.draining
        assert d is not None
        statuses = self._statuses()
        workers_on = frozenset(st.node_id for st in statuses if st.workers)
        d.idle_since = None if workers_on else (d.idle_since or now)
        verdict, why = policy.after_drain(policy.AfterDrain(
            now=now, drained_at=d.since, drained=frozenset(d.node_ids), job_nodes=frozenset(self.alloc.nodes),
            had_workers=d.had_workers, workers_on=workers_on,
            drain_saves=tuple(t for st in statuses for t in st.run_drain_saves.values()), idle_since=d.idle_since,
            deadline=d.deadline), margin_s=self.options.requeue_margin_s)
        if verdict == "moved":
            log.info("%s; no requeue", why)
            self.draining = None
        elif verdict == "requeue":
            log.info("requeueing: %s", why)
        return verdict == "requeue"

    def _requeue(self) -> int:
        """Let the run record the preemption and stop its workers; requeue once all is stopped."""
        assert self.draining is not None
        first, *also = sorted(self.draining.node_ids)
        try:  # a deadline of now: the controller ends the attempt as preempted without waiting on
            request(self.ctx, self.head_address, m.DrainNode(
                node_id=first, also=also, reason="preemption", message=f"{self.draining.why}; requeued",
                deadline_remaining_s=0.0, until_commit=True), timeout_s=5.0, key=self.key)
        except AgentUnavailable as e:
            log.error("could not end the drain of %s: %s", ", ".join(sorted(self.draining.node_ids)), e)
        end = time.monotonic() + 10.0
        while time.monotonic() < end and self._workers_running():
            time.sleep(0.1)
        # The controller writes the preempted attempt into the run's history once its workers are
        # reaped; nothing outside the driver shows that write, so give it a moment before the stop.
        time.sleep(self.options.history_grace_s)
        self.requeue_at_exit = True  # after the teardown: a requeue ends this start of the job at once
        return 0

    # ---- the agents' view ------------------------------------------------------------------

    def _node_table(self) -> list[m.NodeInfo]:
        try:
            reply = request(self.ctx, self.head_address, m.ListNodes(), timeout_s=5.0, key=self.key)
        except AgentUnavailable:
            return []
        return reply.nodes if isinstance(reply, m.NodeList) else []

    def _statuses(self) -> list[m.StatusReply]:
        out = []
        for node in self._node_table():
            if node.state == "dead":  # a failed node (--no-kill): do not wait on it at every turn
                continue
            try:
                reply = request(self.ctx, node.address, m.StatusRequest(), timeout_s=2.0, key=self.key)
            except AgentUnavailable:
                continue
            if isinstance(reply, m.StatusReply):
                out.append(reply)
        return out

    def _workers_running(self) -> bool:
        return any(s.workers for s in self._statuses())

    # ---- stop ------------------------------------------------------------------------------

    def stop_driver(self, grace_s: float = 10.0) -> None:
        """As Ctrl+C does: the driver records the stop, releases its lease and takes its workers down."""
        d = self.driver
        if d is None or d.poll() is not None:
            return
        d.send_signal(signal.SIGINT)
        try:
            d.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("the driver did not stop within %.0f s of SIGINT; killing it", grace_s)
            os.killpg(d.pid, signal.SIGKILL)
            d.wait()

    def teardown(self) -> None:
        self.stop_driver()
        for node in self._node_table():
            if node.state == "dead":
                continue
            try:
                request(self.ctx, node.address, m.Shutdown(), timeout_s=2.0, key=self.key)
            except AgentUnavailable:
                pass
        end = time.monotonic() + 5.0
        while time.monotonic() < end and any(p.poll() is None for p in self.agents.values()):
            time.sleep(0.05)
        for proc in self.agents.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # srun ends the step: SIGTERM to the agent, later SIGKILL
        end = time.monotonic() + 15.0
        for node, proc in self.agents.items():
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("the agent step on %s did not end; killing its srun", node)
                proc.kill()
                proc.wait()
        self.ctx.term()
        shutil.rmtree(self.private, ignore_errors=True)


def private_dir(job_id: str) -> Path:
    """Mode 0700, for this start of this job only: the cluster key and the agents' state. A new one at
    every start: a requeued job's earlier start may have been killed before it cleaned up."""
    return Path(tempfile.mkdtemp(prefix=f"outlast-slurm-job-{job_id}-"))


def run(alloc: Allocation, options: Options) -> int:
    private = private_dir(alloc.job_id)
    key = ClusterKey.generate()
    key.save(private / "cluster.key")
    job = Job(alloc, Slurm(os.environ), options, private, key)
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: job.signals.append(signal.Signals(s)))
    try:
        job.start_agents()
        job.wait_joined()
        job.start_driver()
        code = job.supervise()
    except (RuntimeError, SlurmCommandError) as e:
        log.error("%s", e)
        code = 1
    finally:
        job.teardown()
    if job.requeue_at_exit:
        try:
            job.slurm.requeue(alloc.job_id)
        except SlurmCommandError as e:
            log.error("%s: the job is not requeued (was it submitted with --no-requeue?)", e)
            return 1
        log.info("requeued Slurm job %s; its next start resumes the run", alloc.job_id)
    return code
