"""What the controller's core does with each message from a worker: hello, reports, uploads done,
collectives, preemption queries, progress and stacks, done.

Plain functions over the core's state (`core_state.CoreState`), found by the message's type in
`WORKER_MESSAGES`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from outlast.controller import commit_steps, ending, hang_steps, lifecycle, preempt_steps
from outlast.controller import states as st
from outlast.controller.collectives import Overdue, PendingCollective
from outlast.controller.commits.events import Reported
from outlast.controller.core_state import CoreState
from outlast.controller.states import Event, State
from outlast.controller.types import AttemptState
from outlast.protocol import messages as m
from outlast.protocol.kinds import FailureKind
from outlast.storage.records import FailureRecord

log = logging.getLogger("outlast.controller")

# ---- workers ---------------------------------------------------------------------


# A worker's counts (report index, collective seq, bytes) are below this: one past it is no count of a rank's,
# and the answers made from it (a horizon index + n) would not encode.
MAX_COUNT = 2**53


COUNTS = ("index", "seq", "reports", "count", "fetched_bytes", "total_bytes", "upload_bytes")
_COUNTS_OF: dict[type, tuple[str, ...]] = {}


def _counts_of(kind: type) -> tuple[str, ...]:
    """The counts a kind of message has, looked up once per kind: every message of every rank is checked."""
    names = _COUNTS_OF.get(kind)
    if names is None:
        names = _COUNTS_OF[kind] = tuple(n for n in COUNTS if hasattr(kind, n))
    return names


def on_worker_message(c: CoreState, msg: m.WorkerMessage) -> None:
    a = c.attempt
    if a is None or msg.attempt != a.number:
        return  # a straggler of an attempt that was torn down
    if not 0 <= msg.rank < c.plan.world_size:
        # Counted, a rank the attempt does not have would end it early (WorkerDone) or wait on it forever.
        log.warning("ignored a %s from rank %d: attempt %d has ranks 0 to %d", type(msg).__name__, msg.rank,
                    a.number, c.plan.world_size - 1)
        return
    for name in _counts_of(type(msg)):
        value = getattr(msg, name)
        if not 0 <= value < MAX_COUNT:
            log.warning("ignored a %s from rank %d: its %s is %d, no count of a rank's", type(msg).__name__,
                        msg.rank, name, value)
            return
    handler = WORKER_MESSAGES.get(type(msg))
    if handler is not None:
        handler(c, a, msg)


def _on_upload_done(c: CoreState, a: AttemptState, msg: m.UploadDone) -> None:
    c.uploads.on_upload_done(msg.rank, msg.index)
    for pending in c.commit_tracker.on_upload_done(msg.rank, msg.index, msg.checkpoint_dir, msg.files, msg.error):
        commit_steps.begin(c, pending)
    ending.finish_if_settled(c, a)


def _on_hello(c: CoreState, a: AttemptState, msg: m.WorkerHello) -> None:
    a.hello.add(msg.rank)
    c.send_to_rank(msg.rank, m.Welcome(attempt=a.number, rank=msg.rank), a.number)
    if msg.set_up:
        a.set_up.add(msg.rank)
    if c.state.kind is State.SCHEDULING and len(a.hello) == c.plan.world_size:
        c.go(Event.WORKERS_STARTED, st.Running())


def _on_set_up(c: CoreState, a: AttemptState, msg: m.SetUp) -> None:
    a.set_up.add(msg.rank)
    c.send_to_rank(msg.rank, m.SetUpHeard(attempt=a.number, rank=msg.rank), a.number)


def _on_query(c: CoreState, a: AttemptState, msg: m.PreemptionQuery) -> None:
    preempt_steps.answer(c, c.horizons.on_query(msg.rank, msg.index, c.now))


def _on_done(c: CoreState, a: AttemptState, msg: m.WorkerDone) -> None:
    a.done.add(msg.rank)
    ending.finish_if_settled(c, a)


def _on_checkpoints_query(c: CoreState, a: AttemptState, msg: m.CheckpointsQuery) -> None:
    a.checkpoint_queries[msg.rank] = msg.reports
    ending.answer_checkpoint_queries(c, a)


def on_report(c: CoreState, a: AttemptState, msg: m.Report) -> None:
    incarnation = a.reply_to.get(msg.rank, 0)
    if c.live is not None and c.live.superseded(msg.rank, incarnation) and msg.rank in c.commit_tracker.absent:
        # Sent by a process that is gone, read after its death: its rank waits for its replacement's first report,
        # which goes on from the count of the rank whose state it takes. Counted, it made the rank present again at
        # the dead process's count, and the checkpoint of a step it committed but never reported waited for a
        # report nobody makes, while a survivor in that checkpoint's report() never sent the replacement the state.
        log.info("a report %d of rank %d's process %d, gone since, is not counted: its replacement reports for it",
                 msg.index, msg.rank, incarnation)
        return
    p = preempt_steps.preemption(c)
    if msg.saw_preemption and p is not None:
        p.jit_reports.add((msg.rank, msg.index))
    if msg.rank == 0:
        c.last_metrics = msg.metrics
    if (msg.local_dir or msg.in_memory) and msg.checkpoint_dir is not None:
        # Where the rank's own copy is on its node; whether it goes to a peer's memory first (a notice's).
        commit_steps.step(c, Reported(a.number, msg.index, msg.rank, msg.local_dir, msg.in_memory,
                                      msg.local_dir_stored))
    if msg.upload_pending and msg.checkpoint_dir is not None:
        c.uploads.on_report(msg.rank, msg.index, msg.upload_bytes, msg.upload_bandwidth_bps, c.now)
        if p is not None:
            preempt_steps.forecast_uploads(c, p)
    if msg.in_memory and msg.checkpoint_dir is not None:
        # A notice's checkpoint through a peer: what the deadline weighs is its copy to the peer, at the rate
        # this node's last replica went; it is done once the node's tier has answered for it.
        c.uploads.on_report(msg.rank, msg.index, msg.upload_bytes,
                            c.commits.peer_rate(a.placement.get(msg.rank, "")), c.now)
        if p is not None:
            preempt_steps.forecast_uploads(c, p)
    if c.live is not None and c.live.first_report(msg.rank, incarnation):
        c.commit_tracker.skip_to(msg.rank, msg.index)
    try:
        ready = c.commit_tracker.on_report(msg.rank, msg.index, msg.checkpoint_dir, msg.files, msg.metrics,
                                           msg.upload_pending, msg.upload_files, msg.data_position, msg.generation)
    except ValueError as e:
        log.warning("ignored a report: %s", e)
        return
    for pending in ready:
        commit_steps.begin(c, pending)
    exit = a.exited.get(msg.rank)
    if msg.upload_pending and exit is not None and exit.exit_code == 0 and exit.error is None:
        commit_steps.check_uploads_of(c, a, msg.rank)  # the report came after the rank's exit


# ---- collectives -----------------------------------------------------------------


def on_collective(c: CoreState, a: AttemptState, msg: m.CollectiveRequest) -> None:
    try:
        complete = c.collectives.arrive(msg.rank, msg.seq, msg.op, msg.payload, c.now)
    except ValueError as e:
        log.error("%s", e)
        return
    if complete is not None:
        reply_collective(c, complete)


def reply_collective(c: CoreState, complete: PendingCollective) -> None:
    reply = m.CollectiveReply(seq=complete.seq, payload=complete.payload)
    for rank in range(c.plan.world_size):
        if rank not in c.collectives.lost:
            c.send_to_rank(rank, reply)


def on_overdue_collective(c: CoreState, o: Overdue) -> None:
    if not o.timed_out:
        log.warning("%s #%d has waited %.0f s for ranks %s", o.op, o.seq, o.waited_s, o.missing)
        return
    reply = m.CollectiveTimeout(seq=o.seq, op=o.op, missing_ranks=o.missing, waited_s=o.waited_s)
    for rank in o.arrived:
        c.send_to_rank(rank, reply)




def _on_watch(c: CoreState, a: AttemptState, msg: m.Progress | m.StackDump) -> None:
    hang_steps.on_watch_message(c, msg)


def on_refused(c: CoreState, attempt: int, rank: int, reason: str) -> None:
    """A rank sent a message that does not decode (a file outside its directory): nothing of it is used, and
    its attempt fails with the reason in the run's history. outlast's own workers send no such message."""
    a = c.attempt
    if a is None or attempt != a.number or not 0 <= rank < c.plan.world_size:
        log.warning("dropped a message from rank %d of attempt %d: %s", rank, attempt, reason)
        return
    log.error("rank %d of attempt %d: %s", rank, attempt, reason)
    if c.state.kind.has_live_workers and not a.failed:
        lifecycle.on_failure(c, FailureRecord(
            attempt=attempt, rank=rank, node_id=a.placement.get(rank, ""), pid=a.pids.get(rank, 0), exit_code=None,
            signal=None, time=c.wall(), kind=FailureKind.REFUSED_MESSAGE, message=reason))


WORKER_MESSAGES: dict[type, Callable[[CoreState, AttemptState, Any], None]] = {
    m.Report: on_report, m.UploadDone: _on_upload_done, m.WorkerHello: _on_hello, m.SetUp: _on_set_up,
    m.CollectiveRequest: on_collective,
    m.PreemptionQuery: _on_query, m.Progress: _on_watch, m.StackDump: _on_watch, m.WorkerDone: _on_done,
    m.CheckpointsQuery: _on_checkpoints_query,
}
