"""The core's side of the commit machine (`commits/`): hand it an event with a view of the run, and apply
what it returns, in order.

The machine decides nothing that is the core's: what its outcomes do is here. A commit tells
the ranks blocked in its report() (after the preemption it may answer decided, in
`lifecycle.decide_on_commit`), a refused one tells them why; the run's history changes only
here (`RecordCommit`, then retention lets old checkpoints go: the run state stops naming them
before their delete, so a crash in between leaves only garbage).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from outlast.controller import effects as fx
from outlast.controller import ending, lifecycle
from outlast.controller import states as st
from outlast.controller.commit import PendingCheckpoint
from outlast.controller.commits import events as ce
from outlast.controller.core_state import CoreState
from outlast.controller.retention import checkpoints_to_delete
from outlast.controller.states import Event
from outlast.controller.types import AttemptState
from outlast.protocol import messages as m

log = logging.getLogger("outlast.controller")


def step(c: CoreState, event: ce.Event) -> None:
    for out in c.commits.step(event, c.commit_view(), c.now):
        if isinstance(out, fx.STORAGE_EFFECTS):
            c.storage[out.id] = out
            c.out.append(out)
        elif isinstance(out, fx.TierAsk):
            c.out.append(out)
        else:
            OUTCOMES[type(out)](c, out)


def begin(c: CoreState, pending: PendingCheckpoint) -> None:
    """The reports settled a checkpoint: its commit begins."""
    step(c, ce.Settled(pending))


def check_uploads_of(c: CoreState, a: AttemptState, rank: int) -> None:
    """`rank` exited cleanly: storage says whether the files of its uploads whose done message never came are
    there."""
    uploads = tuple((p.index, p.checkpoint_dir, tuple((f.path, f.size) for f in p.began_with.get(rank, [])))
                    for p in c.commit_tracker.awaiting_uploads_of(rank))
    if uploads:
        step(c, ce.UploadsToCheck(a.number, rank, uploads))


def on_timers(c: CoreState) -> None:
    if c.commits.uploading_from_memory:
        step(c, ce.Timers())


def run_ended(c: CoreState) -> None:
    """The run is closing: a "storage" run frees its copies in the nodes' memory (the close waits for the answers
    a few seconds at most, `Commits.waits_for_frees`)."""
    step(c, ce.RunEnded())


# ---- the outcomes ---------------------------------------------------------------------------


def _committed(c: CoreState, out: ce.CommitDone) -> None:
    a = c.attempt
    if a is None or a.number != out.attempt:
        return  # its ranks are gone; the next attempt restores it
    pending = out.pending
    if lifecycle.decide_on_commit(c, pending):
        reply = m.Committed(index=pending.index, checkpoint_dir=pending.checkpoint_dir)
        for rank in sorted(pending.waiting):
            c.send_to_rank(rank, reply, attempt=out.attempt, report=pending.index)
    ending.finish_if_settled(c, a)


def _commit_failed(c: CoreState, out: ce.CommitRefused) -> None:
    pending, reason = out.pending, out.reason
    log.error("checkpoint %s not committed (the latest committed one stays %s): %s",
              pending.checkpoint_dir, c.book.state.latest_checkpoint, reason)
    if pending.missing_shards:
        c.book.note_uncommitted(pending.checkpoint_dir, reason, c.wall())
    a = c.attempt
    if a is None or a.number != out.attempt:
        return
    for rank in sorted(pending.waiting):
        c.send_to_rank(rank, m.CommitFailed(index=pending.index, reason=reason), attempt=out.attempt,
                       report=pending.index)
    s = c.state
    if isinstance(s, (st.Preempting, st.Saved)) and pending.missing_shards:
        # Waiting longer cannot bring a lost shard back.
        log.warning("restarting from %s now", c.book.state.latest_checkpoint or "scratch")
        lifecycle.restart(c, Event.PREEMPTION_SAFE, s.preemption)
        return
    ending.finish_if_settled(c, a)


def _uploads_checked(c: CoreState, out: ce.UploadsChecked) -> None:
    a, rank, index = c.attempt, out.rank, out.index
    if a is None or a.number != out.attempt or not any(p.index == index
                                                       for p in c.commit_tracker.awaiting_uploads_of(rank)):
        return  # its UploadDone came meanwhile, or the attempt is over
    c.uploads.on_upload_done(rank, index)
    error = None
    if out.missing:
        error = (f"rank {rank} exited before its asynchronous upload said it was done, and storage does not hold "
                 f"what the upload began with: {'; '.join(out.missing)}")
    else:
        log.info("checkpoint %s: rank %d exited before its asynchronous upload said it was done; storage holds "
                 "all %d files it began with, at their sizes", out.checkpoint_dir, rank, len(out.files))
    for pending in c.commit_tracker.on_upload_done(rank, index, out.checkpoint_dir, list(out.files), error):
        begin(c, pending)
    ending.finish_if_settled(c, a)


def _uploads_ended(c: CoreState, out: ce.UploadsEnded) -> None:
    for rank in out.ranks:
        c.uploads.on_upload_done(rank, out.index)


def _head_lost(c: CoreState, out: ce.HeadLost) -> None:
    ending.give_up(c, ending.head_lost_error(c, out.attempt, out.why))


def _durable_done(c: CoreState, out: ce.DurableDone) -> None:
    if c.attempt is not None:
        ending.finish_if_settled(c, c.attempt)


# ---- the history's changes --------------------------------------------------------------------


def _record_commit(c: CoreState, out: ce.RecordCommit) -> None:
    c.book.record_commit(out.manifest)
    apply_retention(c)


def restoring(c: CoreState) -> set[str]:
    """The checkpoint the attempt now running restores, until that attempt commits one of its own: a commit of
    the attempt before it may land once it has begun, while the ranks may still be reading it. A commit of its
    own means every rank has read past its restore, and the usual `num_to_keep` holds again."""
    a = c.attempt
    if a is None or not a.restore or any(r.attempt == a.number for r in c.book.state.checkpoints):
        return set()
    return {a.restore}


def apply_retention(c: CoreState) -> None:
    rule = c.retention
    doomed = checkpoints_to_delete(c.book.state.checkpoints, rule.num_to_keep, rule.score_attribute, rule.score_order)
    doomed = [d for d in doomed if d.checkpoint_dir not in restoring(c)]  # the next commit lets it go
    if not doomed:
        return
    # The run state stops naming them first, so a crash in between leaves only garbage.
    c.book.forget_checkpoints({d.checkpoint_dir for d in doomed})
    c.write_state()
    for d in doomed:
        c.ask_storage(functools.partial(fx.DeleteCheckpoint, checkpoint_dir=d.checkpoint_dir))


def _note_memory(c: CoreState, out: ce.NoteMemory) -> None:
    c.book.note_memory(out.checkpoint_dir, out.holders, out.at)


def _note_files(c: CoreState, out: ce.NoteFiles) -> None:
    """Kept by this driver only, while the history names the checkpoint (the manifest lists every file, not whose
    it is): what a checkpoint lost with its nodes says was lost (`memory_restore.py`)."""
    c.rank_files[out.checkpoint_dir] = out.files
    named = {r.checkpoint_dir for r in c.book.state.checkpoints} | out.holding
    for name in [d for d in c.rank_files if d not in named]:
        del c.rank_files[name]


def _note_durable(c: CoreState, out: ce.NoteDurable) -> None:
    c.book.note_durable(out.checkpoint_dir)


def _note(c: CoreState, out: ce.NoteOnce) -> None:
    if c.book.note_once(out.text, c.wall()):
        if out.warn:
            log.warning("%s", out.warn)
    elif out.debug:
        log.debug("%s", out.debug)


OUTCOMES: dict[type, Callable[[CoreState, Any], None]] = {
    ce.CommitDone: _committed, ce.CommitRefused: _commit_failed, ce.UploadsChecked: _uploads_checked,
    ce.UploadsEnded: _uploads_ended, ce.HeadLost: _head_lost, ce.DurableDone: _durable_done,
    ce.RecordCommit: _record_commit, ce.NoteMemory: _note_memory, ce.NoteFiles: _note_files,
    ce.NoteDurable: _note_durable, ce.NoteOnce: _note,
}
