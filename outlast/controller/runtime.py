"""The controller loop: turns messages into events, events into states, states into effects.

Decisions live in `states.py` (the table), `policy.py` (restart or raise), `placement.py`
(which node runs which rank), `commit.py` (when a checkpoint is whole), `collectives.py`,
`preemption.py` and `retention.py`. This module only carries them out: it talks to the
node agents (through `nodes.py`) and the workers, and writes to storage.
"""

from __future__ import annotations

import logging
import time
import uuid

import zmq

from outlast.controller.collectives import CollectiveTracker
from outlast.controller.commit import CommitTracker, PendingCheckpoint
from outlast.controller.preemption import Decision as PreemptionDecision
from outlast.controller.preemption import HorizonBook
from outlast.controller.policy import FailureDecision, decide_on_failure, pick_root_cause
from outlast.controller.retention import checkpoints_to_delete
from outlast.controller.states import Event, State, transition
from outlast.controller.nodes import AgentLink, Cluster
from outlast.controller.placement import NoCapacity, place
from outlast.controller.types import AttemptState, Preemption, RunPlan, Timeouts
from outlast.protocol import messages as m
from outlast.protocol.transport import AGENT_EVENTS, WORKER_MESSAGES, BadMessage, bind_router, encode
from outlast.storage.records import CorruptDocument, FailureRecord
from outlast.train.errors import PreemptionError, TrainingFailedError

__all__ = ["Cluster", "Controller", "RunPlan", "Timeouts"]

log = logging.getLogger("outlast.controller")


class Controller:
    def __init__(self, plan: RunPlan, cluster: Cluster, ctx: zmq.Context, clock=time.monotonic,
                 bind_host: str = "127.0.0.1") -> None:
        self.plan = plan
        self.cluster = cluster
        self.clock = clock
        self.run_id = uuid.uuid4().hex[:12]
        self.sock, self.address = bind_router(ctx, bind_host, key=cluster.key)
        self.state = State.INITIALIZING
        self.book = plan.book
        self.attempt: AttemptState | None = None
        self.commits = CommitTracker(plan.world_size)
        self.collectives = CollectiveTracker(plan.world_size, plan.timeouts.collective_warn_s,
                                             plan.timeouts.collective_timeout_s)
        self.horizons = HorizonBook()
        self.last_metrics: dict | None = None
        self.failures: list[FailureRecord] = []
        self.error: TrainingFailedError | None = None
        self._next_heartbeat = 0.0
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)

    # ---- the loop -----------------------------------------------------------------

    def run(self) -> None:
        """Drive the run to a terminal state; raise `TrainingFailedError` if it errored."""
        try:
            if not self.cluster.refresh(timeout_s=10.0):
                raise TrainingFailedError(f"the head at {self.cluster.head_address} did not answer", [])
            self._fire(Event.STARTED)
            while not self.state.is_terminal:
                for sock, _ in self._poller.poll(timeout=100):
                    self._drain(sock)
                self._tick(self.clock())
        except KeyboardInterrupt:
            if not self.state.is_terminal:
                self._fire(Event.INTERRUPTED)
            raise
        finally:
            for link in self.cluster.links.values():
                link.send(m.EndRun(run_id=self.run_id))
            self.sock.close(linger=0)
        if self.error is not None:
            raise self.error

    def _link(self, node_id: str) -> AgentLink:
        fresh = node_id not in self.cluster.links
        link = self.cluster.link(node_id)
        if fresh:
            self._poller.register(link.sock, zmq.POLLIN)
            link.send(self._heartbeat())  # the agent knows the run before its workers
        return link

    def _drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if sock is self.sock:
                    self._on_worker_message(frames[0], WORKER_MESSAGES.decode(frames[-1]))
                else:
                    self._on_agent_event(sock, AGENT_EVENTS.decode(frames[-1]))
            except BadMessage as e:
                log.warning("dropped a malformed message: %s", e)
            if self.state.is_terminal:
                return

    def _heartbeat(self) -> m.RunHeartbeat:
        return m.RunHeartbeat(run_id=self.run_id, timeout_s=self.plan.timeouts.driver_lost_after_s,
                              last_commit_at=self._last_commit_this_attempt())

    def _tick(self, now: float) -> None:
        t = self.plan.timeouts
        if now >= self._next_heartbeat:
            beat = self._heartbeat()
            for link in self.cluster.links.values():
                link.send(beat)
            self._next_heartbeat = now + t.heartbeat_interval_s
        self.cluster.note_tick(now)
        self.cluster.poll_table(now)
        if self.plan.lease is not None:
            lost = self.plan.lease.renew_if_due(now)
            if lost:
                self._give_up(lost)
                return
        for overdue in self.collectives.overdue(now):
            self._on_overdue_collective(overdue)
        a = self.attempt
        if a is None:
            return
        self._check_nodes(a, now)
        if self.state.is_terminal:
            return
        if self.horizons.tick(now) is not None:
            log.info("every rank sees get_preemption_info() from call #%d", self.horizons.decision_index)
        if self.state is State.PREEMPTING and a.preemption is not None and now >= a.preemption.safe_after:
            log.warning("the preemption deadline of attempt %d has passed; restarting from %s", a.number,
                        self.book.state.latest_checkpoint or "scratch")
            self._fire(Event.PREEMPTION_SAFE)
            return
        if self.state is State.PREEMPTING and a.preemption is not None and a.preemption.saved \
                and self._room_elsewhere():
            log.info("room for the run appeared; restarting from %s now", a.preemption.saved)
            self._fire(Event.PREEMPTION_SAFE)
            return
        if self.state is State.SCHEDULING and a.respawn_at is not None:
            if now >= a.respawn_at:
                a.respawn_at = None
                self._place_and_spawn(a)
            return
        if self.state is State.SCHEDULING and now - a.started_at > t.worker_start_s:
            missing = sorted(set(range(self.plan.world_size)) - a.hello)
            self._give_up(f"ranks {missing} of attempt {a.number} did not start within {t.worker_start_s:.0f} s "
                          "(OUTLAST_WORKER_START_TIMEOUT_S); is a node's fork server stuck? `outlast status` "
                          "and the nodes' logs tell")
        elif a.all_exited_ok_at is not None and now - a.all_exited_ok_at > t.finish_settle_s:
            log.warning("finishing without the last messages of ranks %s",
                        sorted(set(range(self.plan.world_size)) - a.done))
            self._fire(Event.ALL_FINISHED)

    def _check_nodes(self, a: AttemptState, now: float) -> None:
        """A node lost with workers of this attempt: its ranks failed (or, preempted, are let go)."""
        live = {n for r, n in a.placement.items() if r not in a.exited}
        for node_id, why in self.cluster.lost_nodes(now, live).items():
            log.warning("%s; its ranks %s of attempt %d are lost", why, a.ranks_on({node_id}), a.number)
            if node_id in self.cluster.links:
                self._poller.unregister(self.cluster.links[node_id].sock)
            self.cluster.lose(node_id)
            for rank in a.ranks_on({node_id}):
                if rank in a.exited:
                    continue
                gone = m.WorkerExited(run_id=self.run_id, attempt=a.number, rank=rank, pid=a.pids.get(rank, 0),
                                      exit_code=None,
                                      signal=None, node_id=node_id, error=m.WorkerError(
                                          exc_type="NodeLost", message=why, traceback="", phase="train"))
                self._on_worker_exited(gone)
                if self.state.is_terminal:
                    return

    def _last_commit_this_attempt(self) -> float | None:
        """What a kill would throw away starts here (None: the attempt's start, as the agent knows it)."""
        a, latest = self.attempt, self.book.state.checkpoints[-1:]
        if a is None or not latest or latest[0].attempt != a.number:
            return None
        return latest[0].committed_at

    # ---- events -> states -> effects ---------------------------------------------

    def _fire(self, event: Event) -> None:
        previous, self.state = self.state, transition(self.state, event)
        log.debug("%s --%s--> %s", previous.value, event.value, self.state.value)
        enter = {
            State.SCHEDULING: self._enter_scheduling,
            State.RESTARTING: self._stop_workers,
            State.FINISHED: self._enter_finished,
            State.ERRORED: self._enter_errored,
            State.ABORTED: self._enter_aborted,
        }.get(self.state)
        if enter is not None:
            enter()

    def _enter_scheduling(self) -> None:
        self._remove_uncommitted()
        number = self.book.begin_attempt(time.time())
        self.attempt = a = AttemptState(number=number, started_at=self.clock())
        a.restore = restore = self._restorable_checkpoint()
        self.commits = CommitTracker(self.plan.world_size, shard_holders=self._shard_holders(restore))
        self.collectives = CollectiveTracker(self.plan.world_size, self.plan.timeouts.collective_warn_s,
                                             self.plan.timeouts.collective_timeout_s)
        self.horizons = HorizonBook()
        if number > 1 or restore:
            log.info("starting attempt %d of run %s%s", number, self.plan.name,
                     f", restoring {restore}" if restore else " from scratch")
        if number > 1:
            self.cluster.refresh(timeout_s=1.0)  # place on what the head knows now, if it answers
        self._place_and_spawn(a)

    def _shard_holders(self, restore: str | None) -> set[int] | None:
        if restore is None:
            return None
        try:
            manifest = self.book.store.read_manifest(restore)
        except CorruptDocument:
            return None
        return set(manifest.ranks) if manifest is not None else None

    def _place_and_spawn(self, a: AttemptState) -> None:
        """Place every rank on a node that is alive and not draining, or wait for one (bounded)."""
        now = self.clock()
        placed = place(self.cluster.views(self.run_id), self.plan.world_size, self.plan.per_worker,
                       self.plan.strategy)
        if isinstance(placed, NoCapacity):
            if a.waiting_for_capacity_since is None:
                a.waiting_for_capacity_since = now
                log.warning("attempt %d is waiting for capacity: %s (nodes: %s); retrying for at most %.0f s "
                            "(OUTLAST_CAPACITY_TIMEOUT_S)", a.number, placed.reason, self.cluster.describe(),
                            self.plan.timeouts.capacity_s)
                self.book.set_waiting(placed.reason, time.time())
            if now - a.waiting_for_capacity_since > self.plan.timeouts.capacity_s:
                self._give_up(f"no capacity for attempt {a.number} within {self.plan.timeouts.capacity_s:.0f} s: "
                              f"{placed.reason}. Add a node (outlast start --address HEAD) or raise "
                              "OUTLAST_CAPACITY_TIMEOUT_S")
                return
            a.respawn_at = now + 1.0
            self.cluster.poll_table(now, interval_s=0.5)
            return
        if a.waiting_for_capacity_since is not None:
            log.info("attempt %d found capacity after %.1f s", a.number, now - a.waiting_for_capacity_since)
            self.book.set_waiting(None, time.time())
        a.started_at = now
        a.placement = {spec.rank: node.node_id for node, spec in placed.workers}
        by_node: dict[str, list[m.WorkerSpec]] = {}
        for node, spec in placed.workers:
            by_node.setdefault(node.node_id, []).append(spec)
        env = dict(self.plan.env)
        if self.plan.rendezvous:  # torch.distributed meets at rank 0's node
            env["MASTER_ADDR"] = self.cluster.nodes[a.placement[0]].host
        if self.plan.relax_collectives:
            env["OUTLAST_RELAX_COLLECTIVES"] = "1"
        if len(by_node) > 1:
            log.info("attempt %d: ranks placed on %s", a.number,
                     ", ".join(f"{n} {[s.rank for s in specs]}" for n, specs in by_node.items()))
        for node_id, specs in by_node.items():
            self._link(node_id).send(m.SpawnWorkers(
                run_id=self.run_id, attempt=a.number, controller_address=self.address, workers=specs,
                payload=self.plan.payload, env=env, cwd=self.plan.cwd, sys_path=self.plan.sys_path,
                run_name=self.plan.name, restore_checkpoint=a.restore, resources=self.plan.per_worker,
                run_key=self.book.store.storage.uri(self.book.store.run_dir),
            ))

    def _on_spawn_refused(self, refused: m.SpawnRefused) -> None:
        """A node turned the workers away (it began draining after we placed them): place again."""
        a = self.attempt
        if a is None or refused.attempt != a.number or self.state is not State.SCHEDULING:
            return
        log.warning("attempt %d: %s; placing it again", a.number, refused.reason)
        self._on_failure(FailureRecord(attempt=a.number, rank=0, node_id="", pid=0, exit_code=None, signal=None,
                                       time=time.time(), exc_type="SpawnRefused", message=refused.reason))
        for rank in range(self.plan.world_size):
            if rank not in a.hello:  # those never started; the others report their exit
                a.exited.setdefault(rank, m.WorkerExited(run_id=self.run_id, attempt=a.number, rank=rank, pid=0,
                                                         exit_code=None, signal=None, error=None, node_id=""))
        if len(a.exited) == self.plan.world_size:
            self._settle_failed_attempt()

    def _restorable_checkpoint(self) -> str | None:
        """The latest committed checkpoint whose manifest is still readable; skip (and record) others.

        Only the manifest is read here; the workers check the files against it when they fetch them.
        """
        while (latest := self.book.state.latest_checkpoint) is not None:
            try:
                if self.book.store.read_manifest(latest) is not None:
                    return latest
                reason = "its manifest is gone from storage"
            except CorruptDocument as e:
                reason = str(e)
            fallback = self.book.skip_checkpoint(latest, reason, time.time())
            log.warning("checkpoint %s cannot be restored (%s); using %s instead", latest, reason,
                        fallback or "no checkpoint")
        return None

    def _stop_workers(self) -> None:
        a = self.attempt
        if a is None:
            return
        stop = m.StopWorkers(run_id=self.run_id, attempt=a.number, grace_s=self.plan.timeouts.teardown_grace_s)
        for node_id in set(a.placement.values()):
            if node_id in self.cluster.links:
                self.cluster.links[node_id].send(stop)

    def _remove_uncommitted(self) -> None:
        """Only while no worker of this run is alive: an upload in flight has no manifest yet either."""
        try:
            self.book.store.remove_uncommitted({c.checkpoint_dir for c in self.book.state.checkpoints})
        except OSError as e:
            log.warning("could not remove uncommitted checkpoint directories: %s", e)

    def _enter_finished(self) -> None:
        self._remove_uncommitted()
        self.book.end_attempt("finished", time.time())
        self.book.finish("finished", last_metrics=self.last_metrics)

    def _enter_errored(self) -> None:
        self._teardown_and_wait()
        self._remove_uncommitted()
        self.book.end_attempt("failed", time.time())
        self.book.finish("errored", error=str(self.error), last_metrics=self.last_metrics)

    def _enter_aborted(self) -> None:
        self._teardown_and_wait()
        self._remove_uncommitted()
        self.book.end_attempt("aborted", time.time())
        self.book.finish("aborted", last_metrics=self.last_metrics)

    def _teardown_and_wait(self) -> None:
        """Stop the attempt's workers and wait (bounded) until their agents saw them exit."""
        a = self.attempt
        if a is None:
            return
        self._stop_workers()
        deadline = self.clock() + self.plan.timeouts.teardown_grace_s + 5.0
        links = {self.cluster.links[n].sock for n in set(a.placement.values()) if n in self.cluster.links}
        expected = {r for r, n in a.placement.items() if self.cluster.links.get(n) is not None}
        while not expected <= set(a.exited) and self.clock() < deadline:
            for sock in zmq.select(list(links), [], [], 0.1)[0]:
                try:
                    event = AGENT_EVENTS.decode(sock.recv_multipart()[-1])
                except BadMessage:
                    continue
                if isinstance(event, m.WorkerExited) and event.attempt == a.number:
                    a.exited[event.rank] = event

    # ---- agent events -----------------------------------------------------------------

    def _on_agent_event(self, sock: zmq.Socket, event: m.AgentEvent) -> None:
        for link in self.cluster.links.values():
            if link.sock is sock:
                link.last_reply = self.clock()
                break
        if isinstance(event, m.WorkerExited):
            self._on_worker_exited(event)
        elif isinstance(event, m.WorkerStarted):
            if self.attempt is not None and event.attempt == self.attempt.number and event.run_id == self.run_id:
                self.attempt.pids[event.rank] = event.pid
        elif isinstance(event, m.NodeDraining):
            self._on_node_draining(event)
        elif isinstance(event, m.SpawnRefused):
            self._on_spawn_refused(event)

    def _on_node_draining(self, notice: m.NodeDraining) -> None:
        a = self.attempt
        nodes = set(notice.node_ids) | {notice.node_id}
        self.cluster.note_draining(notice)
        if a is None or self.state not in (State.SCHEDULING, State.RUNNING):
            if a is not None and a.preemption is not None and self.state is State.PREEMPTING:
                self._tighten_deadline(a, notice)
            return  # between attempts: the next placement avoids the draining nodes
        ranks = a.ranks_on(nodes)
        if not ranks:
            return
        now = time.time()
        grace = self.plan.preemption_grace_s
        window = (notice.deadline_unix_s - now + grace) if notice.deadline_unix_s is not None else 120.0 + grace
        a.preemption = Preemption(notice=notice, ranks=ranks, node_ids=sorted(nodes & set(a.placement.values())),
                                  decision_index=self.horizons.preempt(self.clock()), noticed_at=now,
                                  safe_after=self.clock() + max(0.0, window),
                                  reports_at_notice=list(self.commits.reports))
        log.warning("node %s is draining (%s: %s); ranks %s of attempt %d are preempted, and every rank has %.1f s "
                    "to save a checkpoint", ", ".join(a.preemption.node_ids), notice.reason, notice.message, ranks,
                    a.number, max(0.0, window))
        self._fire(Event.PREEMPTION_NOTICE)

    def _tighten_deadline(self, a: AttemptState, notice: m.NodeDraining) -> None:
        """A second drain while saving for the first: the ranks already told keep their answer, but the
        attempt ends by the earlier deadline."""
        ranks = a.ranks_on(set(notice.node_ids) | {notice.node_id})
        if not ranks or notice.deadline_unix_s is None:
            return
        safe_after = self.clock() + max(0.0, notice.deadline_unix_s - time.time() + self.plan.preemption_grace_s)
        if safe_after < a.preemption.safe_after:
            log.warning("node %s is draining too, with an earlier deadline; ranks %s have %.1f s", notice.node_id,
                        ranks, safe_after - self.clock())
            a.preemption.safe_after = safe_after

    def _on_worker_exited(self, ev: m.WorkerExited) -> None:
        a = self.attempt
        if a is None or ev.run_id != self.run_id or ev.attempt != a.number or ev.rank in a.exited:
            return
        a.exited[ev.rank] = ev
        failed = ev.exit_code != 0 or ev.error is not None
        if self.state is State.PREEMPTING and self.plan.relax_collectives and a.preemption is not None \
                and ev.rank in a.preemption.ranks:
            self._lose_preempted_rank(a, ev, failed)
        elif failed:
            self._on_failure(_failure_record(ev))
        elif self.state is State.PREEMPTING:
            # The others go on saving; if every rank returns, the training is over and the run finishes.
            log.warning("rank %d returned from the train function during a preemption", ev.rank)
        if self.state is State.RESTARTING and len(a.exited) == self.plan.world_size:
            self._settle_failed_attempt()
        elif self.state.has_live_workers and len(a.exited) == self.plan.world_size:
            a.all_exited_ok_at = self.clock()
            if a.done >= set(range(self.plan.world_size)):
                self._fire(Event.ALL_FINISHED)

    def _lose_preempted_rank(self, a: AttemptState, ev: m.WorkerExited, failed: bool) -> None:
        """Relaxed collectives: the survivors go on without a rank of a preempted node."""
        a.lost.add(ev.rank)
        if failed:
            a.failures.append(_failure_record(ev))
        log.warning("rank %d (on preempted node %s) is gone; ranks %s go on without it", ev.rank, ev.node_id,
                    sorted(set(range(self.plan.world_size)) - a.lost))
        self.horizons.lose_rank(ev.rank)
        outcome = self.commits.lose_ranks({ev.rank})
        for pending in outcome.settled:
            self._commit(pending)
            if self.state is not State.PREEMPTING:
                return
        for done in self.collectives.lose_ranks({ev.rank}):
            self._reply_collective(done)
        if len(a.exited) == self.plan.world_size and self.state is State.PREEMPTING:
            self._fire(Event.PREEMPTION_SAFE)

    def _on_failure(self, record: FailureRecord) -> None:
        """The first failure ends the attempt; the cause is judged once every worker has exited."""
        assert self.attempt is not None
        self.attempt.failures.append(record)
        self.book.add_failure(record)
        if self.state.has_live_workers:
            self._fire(Event.WORKER_FAILED)

    def _settle_failed_attempt(self) -> None:
        a = self.attempt
        assert a is not None
        if a.preemption is not None:
            self._settle_preempted_attempt(a)
            return
        root = pick_root_cause(a.failures)
        others = [f for f in a.failures if f is not root]
        self.failures += [root, *others]
        also = "".join(f"\n  then {f.describe()}" for f in others)
        corrupt = root.exc_type == "CorruptCheckpointError" and self.book.state.latest_checkpoint
        if corrupt or root.exc_type == "SpawnRefused":
            self.book.settle_failed_attempt(root, "corrupt_checkpoint" if corrupt else "placement", time.time())
            if corrupt:
                fallback = self.book.skip_checkpoint(self.book.state.latest_checkpoint, root.message or "unreadable",
                                                     time.time())
                log.warning("%s; restarting from %s instead (not counted against max_failures)", root.message,
                            fallback or "scratch")
            self._fire(Event.RETRY)
            return
        decision = decide_on_failure(root, self.book.failures_this_launch("worker"), self.plan.max_failures)
        self.book.settle_failed_attempt(root, "worker", time.time())
        if root.traceback:
            log.warning("rank %d failed:\n%s", root.rank, root.traceback.rstrip())
        if decision.action is FailureDecision.RESTART:
            log.warning("%s%s", decision.reason, also)
            self._fire(Event.RETRY)
            return
        causes = "\n".join(f"  attempt {f.attempt}: {f.describe()}" for f in self.failures)
        self.error = TrainingFailedError(f"training failed: {decision.reason}\nfailures (root cause of each "
                                         f"attempt first):\n{causes}", list(self.failures))
        self._fire(Event.GIVE_UP)

    def _settle_preempted_attempt(self, a: AttemptState) -> None:
        assert a.preemption is not None
        root = a.preemption.as_failure(a.number)
        self.book.add_failure(root)
        self.failures += [root, *a.failures]
        decision = decide_on_failure(root, self.book.failures_this_launch("preemption"),
                                     self.plan.max_preemption_failures, budget="max_preemption_failures")
        self.book.settle_failed_attempt(root, "preemption", time.time())
        if decision.action is FailureDecision.RESTART:
            log.warning("%s", decision.reason)
            self._fire(Event.RETRY)
            return
        self.error = PreemptionError(f"training stopped: {decision.reason}", list(self.failures))
        self._fire(Event.GIVE_UP)

    def _give_up(self, reason: str) -> None:
        self.error = TrainingFailedError(f"training failed: {reason}", list(self.failures))
        log.error("%s", reason)
        self._fire(Event.UNRECOVERABLE)

    # ---- worker messages ---------------------------------------------------------------

    def _on_worker_message(self, identity: bytes, msg: m.WorkerMessage) -> None:
        a = self.attempt
        if a is None or msg.attempt != a.number:
            return  # a straggler of an attempt that was torn down
        if isinstance(msg, m.Report):
            self._on_report(msg)
        elif isinstance(msg, m.UploadDone):
            for pending in self.commits.on_upload_done(msg.rank, msg.index, msg.checkpoint_dir, msg.files, msg.error):
                self._commit(pending)
        elif isinstance(msg, m.WorkerHello):
            a.hello.add(msg.rank)
            if self.state is State.SCHEDULING and len(a.hello) == self.plan.world_size:
                self._fire(Event.WORKERS_STARTED)
        elif isinstance(msg, m.CollectiveRequest):
            self._on_collective(msg)
        elif isinstance(msg, m.PreemptionQuery):
            answer = self.horizons.on_query(msg.rank, msg.index, self.clock())
            if isinstance(answer, PreemptionDecision) and a.preemption is not None:
                n = a.preemption.notice
                self._send_to_rank(msg.rank, m.PreemptionNotice(
                    index=msg.index, decision_index=answer.decision_index, node_ids=a.preemption.node_ids,
                    node_to_ranks={n: a.ranks_on({n}) for n in a.preemption.node_ids},
                    ranks=a.preemption.ranks, reason=n.reason, message=n.message,
                    deadline_unix_ms=int(n.deadline_unix_s * 1000) if n.deadline_unix_s is not None else None))
            else:
                self._send_to_rank(msg.rank, m.PreemptionGrant(index=msg.index, horizon=answer.horizon,
                                                               valid_s=answer.valid_s))
        elif isinstance(msg, m.WorkerDone):
            a.done.add(msg.rank)
            if a.all_exited_ok_at is not None and a.done >= set(range(self.plan.world_size)):
                self._fire(Event.ALL_FINISHED)

    def _on_report(self, msg: m.Report) -> None:
        if msg.saw_preemption and self.attempt is not None:
            self.attempt.jit_reports.add((msg.rank, msg.index))
        if msg.rank == 0:
            self.last_metrics = msg.metrics
        try:
            ready = self.commits.on_report(msg.rank, msg.index, msg.checkpoint_dir, msg.files, msg.metrics,
                                           msg.upload_pending)
        except ValueError as e:
            log.warning("ignored a report: %s", e)
            return
        for pending in ready:
            self._commit(pending)

    def _commit(self, pending: PendingCheckpoint) -> None:
        a = self.attempt
        assert a is not None
        try:
            if pending.missing_shards:
                raise ValueError(pending.missing_reason(a.placement))
            if pending.errors:
                raise ValueError("; ".join(f"rank {r}: {e}" for r, e in sorted(pending.errors.items())))
            files = _merge_files(pending)
            self.book.commit_checkpoint(pending.checkpoint_dir, a.number, pending.index, sorted(pending.files), files,
                                        pending.metrics, time.time())
        except (ValueError, OSError) as e:
            reply: m.Msg = m.CommitFailed(index=pending.index, reason=str(e))
            log.error("checkpoint %s not committed (the latest committed one stays %s): %s",
                      pending.checkpoint_dir, self.book.state.latest_checkpoint, e)
            if pending.missing_shards:
                self.book.note_uncommitted(pending.checkpoint_dir, str(e), time.time())
        else:
            self._apply_retention()
            reply = m.Committed(index=pending.index, checkpoint_dir=pending.checkpoint_dir)
        p = a.preemption
        if self.state is State.PREEMPTING and p is not None and isinstance(reply, m.Committed) \
                and self._saved_for_preemption(a, p, pending):
            p.saved = pending.checkpoint_dir
            if self._room_elsewhere():
                # The ranks stay blocked in that report() until the teardown reaches them: a step
                # they took after it would be lost.
                log.info("checkpoint %s, saved after the preemption notice, is committed; restarting now",
                         pending.checkpoint_dir)
                self._fire(Event.PREEMPTION_SAFE)
                return
            log.warning("checkpoint %s, saved after the preemption notice, is committed, but no node that is not "
                        "draining has room for the run; it trains on until the deadline or until room appears",
                        pending.checkpoint_dir)
        for rank in sorted(pending.waiting):
            self._send_to_rank(rank, reply)
        if self.state is not State.PREEMPTING or p is None:
            return
        if pending.missing_shards:
            # Waiting longer cannot bring a lost shard back.
            log.warning("restarting from %s now", self.book.state.latest_checkpoint or "scratch")
            self._fire(Event.PREEMPTION_SAFE)

    def _room_elsewhere(self) -> bool:
        return not isinstance(place(self.cluster.views(self.run_id), self.plan.world_size, self.plan.per_worker,
                                    self.plan.strategy), NoCapacity)

    def _saved_for_preemption(self, a: AttemptState, p: Preemption, pending: PendingCheckpoint) -> bool:
        """A loop that asks get_preemption_info() gets to save its just-in-time checkpoint: only one
        saved after the notice reached it counts. A loop that never asks has its first checkpoint
        reported after the notice count."""
        if self.horizons.watched:
            return all((r, pending.index) in a.jit_reports for r in pending.files)
        return all(pending.index >= p.reports_at_notice[r] for r in pending.files)

    def _apply_retention(self) -> None:
        doomed = checkpoints_to_delete(self.book.state.checkpoints, self.plan.num_to_keep,
                                       self.plan.score_attribute, self.plan.score_order)
        if doomed:
            # The run state stops naming them first, so a crash in between leaves only garbage.
            self.book.forget_checkpoints({c.checkpoint_dir for c in doomed})
            for c in doomed:
                self.book.store.delete_checkpoint(c.checkpoint_dir)

    def _on_collective(self, msg: m.CollectiveRequest) -> None:
        try:
            complete = self.collectives.arrive(msg.rank, msg.seq, msg.op, msg.payload, self.clock())
        except ValueError as e:
            log.error("%s", e)
            return
        if complete is not None:
            self._reply_collective(complete)

    def _reply_collective(self, complete) -> None:
        reply = m.CollectiveReply(seq=complete.seq, payload=complete.payload)
        for rank in range(self.plan.world_size):
            if rank not in self.collectives.lost:
                self._send_to_rank(rank, reply)

    def _on_overdue_collective(self, o) -> None:
        if not o.timed_out:
            log.warning("%s #%d has waited %.0f s for ranks %s", o.op, o.seq, o.waited_s, o.missing)
            return
        reply = m.CollectiveTimeout(seq=o.seq, op=o.op, missing_ranks=o.missing, waited_s=o.waited_s)
        for rank in o.arrived:
            self._send_to_rank(rank, reply)

    def _send_to_rank(self, rank: int, msg: m.Msg) -> None:
        a = self.attempt
        assert a is not None
        self.sock.send_multipart([worker_identity(a.number, rank), encode(msg)])


def worker_identity(attempt: int, rank: int) -> bytes:
    return f"{attempt}:{rank}".encode()


def _failure_record(ev: m.WorkerExited) -> FailureRecord:
    err = ev.error
    return FailureRecord(
        attempt=ev.attempt, rank=ev.rank, node_id=ev.node_id, pid=ev.pid, exit_code=ev.exit_code,
        signal=ev.signal, time=time.time(),
        exc_type=err.exc_type if err else None, message=err.message if err else None,
        traceback=err.traceback if err else None, phase=err.phase if err else None,
        oom_report=ev.oom_report,
    )


def _merge_files(pending: PendingCheckpoint) -> list[m.FileEntry]:
    """Files of all contributing ranks; two ranks may write one file only with the same bytes."""
    merged: dict[str, tuple[int, m.FileEntry]] = {}
    for rank in sorted(pending.files):
        for entry in pending.files[rank]:
            seen = merged.get(entry.path)
            if seen is not None and seen[1].checksum != entry.checksum:
                raise ValueError(
                    f"ranks {seen[0]} and {rank} both wrote {entry.path!r} with different contents; "
                    "save a replicated model from one rank only, or give each rank its own file names"
                )
            merged[entry.path] = (rank, entry)
    return [e for _, e in sorted(merged.values(), key=lambda x: x[1].path)]
