"""How a run ends: it gives up, or finishes once every report, upload and commit has settled; its workers are
stopped, and it closes once they are gone.

Plain functions over the core's state (`core_state.CoreState`); the state changes they make
follow the table in `states.py`.
"""

from __future__ import annotations

import logging

from outlast.controller import effects as fx
from outlast.controller import states as st
from outlast.controller.core_state import CoreState
from outlast.controller.group import StopRun, ToNode
from outlast.controller.preempt_steps import answer
from outlast.controller.states import Event, State
from outlast.controller.types import AttemptState
from outlast.errors import TrainingFailedError
from outlast.protocol import messages as m

log = logging.getLogger("outlast.controller")

TEARDOWN_EXTRA_S = 5.0


def remove_uncommitted(c: CoreState, from_attempt: int | None = None) -> None:
    """Only while no worker of an attempt before `from_attempt` is alive: an upload in flight has no manifest
    yet either. Storage may reach it late (effects go in order, and it may be slow), so the directories of
    `from_attempt` and later, whose ranks may have started by then, are never garbage to it."""
    keep = frozenset({r.checkpoint_dir for r in c.book.state.checkpoints} | c.commits.in_progress())
    c.ask_storage(lambda i: fx.RemoveUncommitted(i, keep, from_attempt))


def head_lost_error(c: CoreState, attempt: int, why: str) -> str:
    latest = c.book.state.latest_checkpoint
    return (f"{why}. The run stops here, with attempt {attempt}; its latest committed checkpoint stays "
            f"{latest or 'none'}. Start the head again (`outlast start` on its machine, with the same "
            "--port and cluster key) and run fit() again with the same RunConfig(name, storage_path) to go on "
            "from there. A cluster whose nodes keep its state in etcd (`outlast start --etcd URL,...`, "
            "docs/operations/etcd.md) has no single head to lose")


def give_up(c: CoreState, reason: str) -> None:
    c.error = TrainingFailedError(f"training failed: {reason}", list(c.failures))
    log.error("%s", reason)
    c.go(Event.UNRECOVERABLE, st.Errored(error=c.error, stop_by=stop_by(c, c.now)))
    stop_workers(c)
    close_if_stopped(c, c.now)


def finish(c: CoreState) -> None:
    c.go(Event.ALL_FINISHED, st.Finished())
    close_if_stopped(c, c.now)


def stop_by(c: CoreState, now: float) -> float:
    return now + c.plan.timeouts.teardown_grace_s + TEARDOWN_EXTRA_S


def stop_workers(c: CoreState) -> None:
    a = c.attempt
    if a is None:
        return
    answer(c, c.horizons.release())  # no rank waits on a decision while it is stopped
    if a.stopped_at is None:
        a.stopped_at = c.now
    stop = m.StopWorkers(run_id=c.run_id, attempt=a.number, grace_s=c.plan.timeouts.teardown_grace_s)
    # A drained process that a live move replaced may still run where its rank was.
    for node_id in sorted(set(a.placement.values()) | {node for _, node in a.retiring}):
        if node_id in c.nodes.heard:
            c.out.append(StopRun(node_id, stop))


def close_if_stopped(c: CoreState, now: float) -> None:
    """A terminal state closes the run once its workers are gone, or the wait for them is over; the run
    is `closed` once storage has answered what it was given."""
    s, a = c.state, c.attempt
    if c.closing:
        return
    if isinstance(s, (st.Errored, st.Aborted)) and a is not None and now < s.stop_by:
        expected = {r for r, n in a.placement.items() if n in c.nodes.heard}
        if not expected <= set(a.exited):
            return
    remove_uncommitted(c)
    outcome = {State.FINISHED: "finished", State.ERRORED: "failed", State.ABORTED: "aborted"}[s.kind]
    c.book.end_attempt(outcome, c.wall())
    c.book.finish(s.kind.value, error=str(c.error) if isinstance(s, st.Errored) else None,
                  last_metrics=c.last_metrics)
    c.out += [ToNode(n, m.EndRun(run_id=c.run_id)) for n in sorted(c.nodes.heard)]
    c.closing = True  # the core hands the commit machine the run's end: its copies in memory are freed


def finish_without_last_messages(c: CoreState, a: AttemptState) -> None:
    unsaid = [f"{p.checkpoint_dir} of ranks {sorted(p.awaiting)}" for r in range(c.plan.world_size)
              for p in c.commit_tracker.awaiting_uploads_of(r) if min(p.awaiting) == r]
    log.warning("finishing without the last messages of ranks %s%s", sorted(set(range(c.plan.world_size)) - a.done),
                f"; asynchronous uploads never said they were done, and their files were not known when they began "
                f"(a staged save writes them later), so these checkpoints are not committed: {', '.join(unsaid)}"
                if unsaid else "")
    finish(c)


# ---- finishing, once every report, upload and commit has settled ---------------------------


def answer_checkpoint_queries(c: CoreState, a: AttemptState) -> None:
    """Each waiting rank gets the kept checkpoints once none of those it reported is still on its way."""
    for rank, reports in sorted(a.checkpoint_queries.items()):
        if c.commit_tracker.unsettled_below(reports) or c.commits.unsettled_below(a.number, reports):
            continue
        del a.checkpoint_queries[rank]
        kept = [m.KeptCheckpoint(checkpoint_dir=r.checkpoint_dir, seq=r.seq, metrics=r.metrics)
                for r in c.book.state.checkpoints]
        c.send_to_rank(rank, m.CheckpointsList(checkpoints=kept), attempt=a.number)


def finish_if_settled(c: CoreState, a: AttemptState) -> None:
    """Called whenever a report, an upload or a commit has settled."""
    answer_checkpoint_queries(c, a)
    if c.state.kind is State.FINISHING and settled(c, a):
        finish(c)


def settled(c: CoreState, a: AttemptState) -> bool:
    """Every rank said it is done, every asynchronous upload it reported said so too, and every
    commit begun has ended. The upload thread has a connection of its own, so its last UploadDone
    may arrive after the rank's WorkerDone and its exit: finishing before it, or before its
    commit's manifest is written, would drop the last checkpoint."""
    return a.done >= set(range(c.plan.world_size)) and not c.commit_tracker.uploads_in_flight \
        and not c.commits.in_progress()
