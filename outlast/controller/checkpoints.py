"""Checkpoints in the controller's core: the commit in two phases, retention, what a new attempt restores.

Each storage call is an effect (`effects.py`) whose answer comes back as an event:

1. A settled checkpoint (`commit.py`) gets its manifest written (`WriteManifest`); files that
   ranks wrote differently are read back first (`ReadChecksums`, `file_merge.py` decides).
2. Once storage says the manifest is written, the checkpoint is committed: the history names
   it, its blocked ranks hear `Committed`, and retention hands storage the deletes, after the
   run state that stops naming them.

Nothing after the manifest can take the commit back. A write that still fails after its
retries fails the run, saying what storage did (`on_storage_failed`); a delete that fails
leaves the files, with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from outlast.controller import effects as fx
from outlast.controller import lifecycle, memory_holds, memory_restore, on_workers, peer_uploads
from outlast.controller import states as st
from outlast.controller.commit import PendingCheckpoint
from outlast.controller.file_merge import DuplicateFiles, MergedFiles, merge_files, settle
from outlast.controller.retention import checkpoints_to_delete
from outlast.controller.states import Event
from outlast.controller.types import AttemptState
from outlast.protocol import messages as m
from outlast.protocol.messages import FileEntry
from outlast.storage.records import Manifest
from outlast.storage.retry import RETRY_S_VAR

if TYPE_CHECKING:
    from outlast.controller.core import ControllerCore

log = logging.getLogger("outlast.controller")


@dataclass(frozen=True)
class RetentionRule:
    num_to_keep: int | None
    score_attribute: str | None
    score_order: str


@dataclass(frozen=True)
class Committing:
    """A manifest handed to storage, not yet said to be written."""

    pending: PendingCheckpoint
    attempt: int
    manifest: Manifest


# ---- the commit ---------------------------------------------------------------------------


def begin_commit(c: "ControllerCore", pending: PendingCheckpoint) -> None:
    """Phase one: check the settled checkpoint, and hand its manifest to storage."""
    a = c.attempt
    assert a is not None
    if pending.missing_shards:
        fail_commit(c, pending, a.number, pending.missing_reason(a.placement))
        return
    if pending.errors:
        fail_commit(c, pending, a.number, "; ".join(f"rank {r}: {e}" for r, e in sorted(pending.errors.items())))
        return
    try:
        merged = merge_files(pending.files, DuplicateFiles(c.plan.duplicate_files))
    except ValueError as e:
        fail_commit(c, pending, a.number, str(e))
        return
    if not merged.conflicts:
        commit_files(c, pending, a.number, merged.files)
        return
    if c.plan.checkpoint_storage == memory_holds.MEMORY or peer_uploads.is_through_peer(c, a.number, pending.index):
        # Nothing is in storage to read back: every rank's copy is in its own node's memory, so the
        # lowest rank's (rank 0's, where it wrote one) is the one kept.
        kept = settle(merged, {x.path: x.entries[0].checksum for x in merged.conflicts})
        _say_kept(c, pending, kept)
        commit_files(c, pending, a.number, kept.files)
        return
    paths = tuple((conflict.path, conflict.entries[0].checksum[0]) for conflict in merged.conflicts)
    c.reading_back[pending.checkpoint_dir] = pending
    c.ask_storage(lambda i: fx.ReadChecksums(i, pending.checkpoint_dir, paths),
                  partial(_checksums_read, pending=pending, attempt=a.number, merged=merged))


def in_progress(c: "ControllerCore") -> set[str]:
    """Checkpoints whose commit has begun and not ended, or whose uploads storage is asked about: their
    directories are not garbage."""
    return set(c.reading_back) | {x.manifest.checkpoint_dir for x in c.committing.values()} \
        | {name for _, _, _, name in c.checking_uploads.values()} | memory_holds.pending_in_memory(c) \
        | peer_uploads.in_flight(c)


def unsettled_below(c: "ControllerCore", a: AttemptState, index: int) -> bool:
    """Whether a checkpoint of attempt `a` among reports below `index` is neither committed nor refused yet."""
    return c.commits.unsettled_below(index) or any(p.index < index for p in c.reading_back.values()) \
        or any(x.attempt == a.number and x.pending.index < index for x in c.committing.values()) \
        or any(h.attempt == a.number and h.on_all is not None and h.index < index for h in c.holds.values())


def _checksums_read(c: "ControllerCore", done: fx.ChecksumsRead, pending: PendingCheckpoint, attempt: int,
                    merged: MergedFiles) -> None:
    c.reading_back.pop(pending.checkpoint_dir, None)
    try:
        merged = settle(merged, done.checksums)
    except ValueError as e:
        fail_commit(c, pending, attempt, str(e))
        return
    _say_kept(c, pending, merged)
    commit_files(c, pending, attempt, merged.files)


def _say_kept(c: "ControllerCore", pending: PendingCheckpoint, merged: MergedFiles) -> None:
    kept = ", ".join(f"{conflict.path!r} from rank {conflict.kept}" for conflict in merged.conflicts)
    if c.book.note_once(merged.describe(), c.wall()):
        log.warning("checkpoint %s: %s (this one kept %s)", pending.checkpoint_dir, merged.describe(), kept)
    else:
        log.debug("checkpoint %s kept %s", pending.checkpoint_dir, kept)


def _next_seq(c: "ControllerCore") -> int:
    return max([r.seq for r in c.book.state.checkpoints] + [x.manifest.seq for x in c.committing.values()]
               + [h.seq for h in c.holds.values()], default=0) + 1


def commit_files(c: "ControllerCore", pending: PendingCheckpoint, attempt: int, files: list[FileEntry]) -> None:
    """The checked files' commit, at the run's level: the manifest now (and copies in memory beside it),
    or once two nodes keep every rank's files in memory (`memory_holds.py`)."""
    seq = _next_seq(c)
    local_dirs = memory_holds.local_dirs_of(c, pending, attempt)
    through_peer = peer_uploads.is_through_peer(c, attempt, pending.index)  # a notice's: storage follows
    if c.plan.checkpoint_storage != memory_holds.MEMORY and not through_peer:
        write_manifest(c, pending, attempt, files, seq)
        memory_holds.keep_beside(c, pending, attempt, seq, local_dirs)
        return

    def held(c: "ControllerCore", h: memory_holds.Holding) -> None:
        ok, why = memory_holds.in_memory(c, h)
        for rank in pending.files:
            c.uploads.on_upload_done(rank, pending.index)  # the copies to the peers have answered
        if ok and through_peer:
            peer_uploads.upload_after(c, h)
        if not ok:
            c.holds.pop(h.checkpoint_dir, None)
            fail_commit(c, pending, attempt, f"not committed in memory: {why}")
            return
        write_manifest(c, pending, attempt, files, seq, memory={r: sorted(ns) for r, ns in h.holders.items()},
                       durable=False)

    stuck = memory_holds.stuck_without_head(c)
    if stuck is not None:  # every later attempt would fail its commits the same way: the run cannot go on
        lifecycle.give_up(c, lifecycle.head_lost_error(c, attempt, stuck))
        return
    why = memory_holds.commit_in_memory(c, pending, attempt, seq, local_dirs, held)
    if why is not None:
        fail_commit(c, pending, attempt, why)


def write_manifest(c: "ControllerCore", pending: PendingCheckpoint, attempt: int, files: list[FileEntry], seq: int,
                   memory: dict[int, list[str]] | None = None, durable: bool = True) -> None:
    """`memory`: rank -> the nodes that keep its files, for a checkpoint committed in memory."""
    now = c.wall()
    nodes = sorted({n for ns in (memory or {}).values() for n in ns})
    manifest = Manifest(checkpoint_dir=pending.checkpoint_dir, seq=seq, attempt=attempt,
                        report_index=pending.index, committed_at=now, ranks=sorted(pending.files), files=files,
                        metrics=pending.metrics, memory=nodes, memory_at=now if memory else None,
                        durable=durable, memory_ranks=dict(memory or {}))
    effect_id = c.ask_storage(lambda i: fx.WriteManifest(i, manifest), _manifest_written)
    c.committing[effect_id] = Committing(pending, attempt, manifest)


def _manifest_written(c: "ControllerCore", done: fx.StorageDone) -> None:
    """Phase two: committed. The history names it; its ranks hear it; retention lets old ones go."""
    committing = c.committing.pop(done.id)
    pending = committing.pending
    c.book.record_commit(committing.manifest)
    peer_uploads.after_commit(c, committing.manifest)
    apply_retention(c)
    a = c.attempt
    if memory_holds.hold_commit_back(c, pending.checkpoint_dir, committing):
        return  # its ranks hear it once their nodes have copied their files (memory_holds.py)
    if a is None or a.number != committing.attempt:
        return  # its ranks are gone; the next attempt restores it
    tell_ranks(c, committing)
    on_workers.finish_if_settled(c, a)


def tell_ranks(c: "ControllerCore", committing: Committing) -> None:
    pending, s = committing.pending, c.state
    reply = m.Committed(index=pending.index, checkpoint_dir=pending.checkpoint_dir)
    if isinstance(s, st.Preempting) and s.preemption.saved_by(pending.index, pending.files, c.horizons.watched):
        verdict = s.preemption.decide(c.now, pending.checkpoint_dir, lifecycle.room_elsewhere(c, c.now))
        if verdict.restart_now:
            # The ranks stay blocked in that report() until the teardown reaches them: a step
            # they took after it would be lost.
            log.info("%s; restarting now", verdict.reason)
            lifecycle.restart(c, Event.PREEMPTION_SAFE, s.preemption)
            return
        log.warning("%s", verdict.reason)
        lifecycle.go(c, Event.SAVED_NOWHERE_TO_GO, st.Saved(s.preemption, pending.checkpoint_dir))
        if s.preemption.notice.until_commit:
            # Its nodes go away now that it is committed (a Slurm job is requeued): nothing the loop
            # does from here is kept, so the ranks that wait for it wait until the teardown.
            log.info("checkpoint %s is the last this attempt commits (the drain ends with it); its ranks wait in "
                     "report() until the run stops", pending.checkpoint_dir)
            return
    for rank in sorted(pending.waiting):
        c.send_to_rank(rank, reply, attempt=committing.attempt)


def check_uploads_of(c: "ControllerCore", a: AttemptState, rank: int) -> None:
    """`rank` exited cleanly, and so every upload it began has ended; those whose UploadDone has not come
    may have lost it at the exit (the upload thread's socket). Storage says whether their files are there."""
    asked = {(r, i) for n, r, i, _ in c.checking_uploads.values() if n == a.number}
    for pending in c.commits.awaiting_uploads_of(rank):
        files = tuple((f.path, f.size) for f in pending.began_with.get(rank, []))
        if not files or (rank, pending.index) in asked:  # a staged save writes its files after the report
            continue
        effect_id = c.ask_storage(lambda i, p=pending: fx.CheckUploads(i, p.checkpoint_dir, files),  # noqa: B023 - called before the loop goes on
                                  _uploads_checked)
        c.checking_uploads[effect_id] = (a.number, rank, pending.index, pending.checkpoint_dir)


def _uploads_checked(c: "ControllerCore", found: fx.UploadsFound) -> None:
    number, rank, index, name = c.checking_uploads.pop(found.id)
    a = c.attempt
    if a is None or a.number != number or not any(p.index == index for p in c.commits.awaiting_uploads_of(rank)):
        return  # its UploadDone came meanwhile, or the attempt is over
    c.uploads.on_upload_done(rank, index)
    error = None
    if found.missing:
        error = (f"rank {rank} exited before its asynchronous upload said it was done, and storage does not hold "
                 f"what the upload began with: {'; '.join(found.missing)}")
    else:
        log.info("checkpoint %s: rank %d exited before its asynchronous upload said it was done; storage holds "
                 "all %d files it began with, at their sizes", name, rank, len(found.files))
    for pending in c.commits.on_upload_done(rank, index, name, list(found.files), error):
        begin_commit(c, pending)
    on_workers.finish_if_settled(c, a)


def fail_commit(c: "ControllerCore", pending: PendingCheckpoint, attempt: int, reason: str) -> None:
    log.error("checkpoint %s not committed (the latest committed one stays %s): %s",
              pending.checkpoint_dir, c.book.state.latest_checkpoint, reason)
    if pending.missing_shards:
        c.book.note_uncommitted(pending.checkpoint_dir, reason, c.wall())
    a = c.attempt
    if a is None or a.number != attempt:
        return
    for rank in sorted(pending.waiting):
        c.send_to_rank(rank, m.CommitFailed(index=pending.index, reason=reason), attempt=attempt)
    s = c.state
    if isinstance(s, (st.Preempting, st.Saved)) and pending.missing_shards:
        # Waiting longer cannot bring a lost shard back.
        log.warning("restarting from %s now", c.book.state.latest_checkpoint or "scratch")
        lifecycle.restart(c, Event.PREEMPTION_SAFE, s.preemption)
        return
    on_workers.finish_if_settled(c, a)


def on_storage_failed(c: "ControllerCore", effect: fx.StorageEffect, failed: fx.StorageFailed) -> None:
    """Storage still failed after its retries. A lost write fails the run; a lost delete leaves files."""
    said = (f"storage failed {failed.what} ({failed.error}), retried for {RETRY_S_VAR} seconds; the latest "
            f"committed checkpoint stays {c.book.state.latest_checkpoint or 'none'}. Once storage is back, run "
            "fit() again with the same RunConfig(name, storage_path) to go on from there")
    if isinstance(effect, fx.DeleteCheckpoint):
        log.warning("could not delete checkpoint %s, which CheckpointConfig(num_to_keep=%s) lets go (%s); the run "
                    "goes on, and the files stay until deleted by hand", effect.checkpoint_dir, c.retention.num_to_keep,
                    failed.error)
        return
    if isinstance(effect, fx.WriteManifest):
        committing = c.committing.pop(failed.id)
        fail_commit(c, committing.pending, committing.attempt, f"storage failed {failed.what}: {failed.error}")
    if isinstance(effect, fx.ReadChecksums):
        c.reading_back.pop(effect.checkpoint_dir, None)
    if isinstance(effect, fx.CheckUploads):  # not a write: the checkpoint is not committed, the run goes on
        _uploads_checked(c, fx.UploadsFound(failed.id, missing=(f"storage failed {failed.what}: {failed.error}",)))
        return
    if not c.state.kind.is_terminal:
        lifecycle.give_up(c, said)
    elif c.error is None:
        from outlast.errors import TrainingFailedError

        log.error("%s", said)
        c.error = TrainingFailedError(f"training failed: {said}", list(c.failures))


# ---- retention and clean-up ---------------------------------------------------------------


def restoring(c: "ControllerCore") -> set[str]:
    """The checkpoint the attempt now running restores, until that attempt commits one of its own: a commit of
    the attempt before it may land once it has begun, while the ranks may still be reading it. A commit of its
    own means every rank has read past its restore, and the usual `num_to_keep` holds again."""
    a = c.attempt
    if a is None or not a.restore or any(r.attempt == a.number for r in c.book.state.checkpoints):
        return set()
    return {a.restore}


def apply_retention(c: "ControllerCore") -> None:
    rule = c.retention
    doomed = checkpoints_to_delete(c.book.state.checkpoints, rule.num_to_keep, rule.score_attribute, rule.score_order)
    doomed = [d for d in doomed if d.checkpoint_dir not in restoring(c)]  # the next commit lets it go
    if not doomed:
        return
    from outlast.controller.core import write_state

    # The run state stops naming them first, so a crash in between leaves only garbage.
    c.book.forget_checkpoints({d.checkpoint_dir for d in doomed})
    write_state(c)
    for d in doomed:
        c.ask_storage(lambda i, name=d.checkpoint_dir: fx.DeleteCheckpoint(i, name))


def remove_uncommitted(c: "ControllerCore", from_attempt: int | None = None) -> None:
    """Only while no worker of an attempt before `from_attempt` is alive: an upload in flight has no manifest
    yet either. Storage may reach it late (effects go in order, and it may be slow), so the directories of
    `from_attempt` and later, whose ranks may have started by then, are never garbage to it."""
    keep = frozenset({r.checkpoint_dir for r in c.book.state.checkpoints} | in_progress(c))
    c.ask_storage(lambda i: fx.RemoveUncommitted(i, keep, from_attempt))


# ---- what a new attempt restores ------------------------------------------------------------


def read_restorable(c: "ControllerCore", a: AttemptState) -> None:
    """The latest committed checkpoint whose manifest is still readable; others are skipped (and recorded).

    Only the manifests are read; the workers check the files against them when they fetch them.
    """
    latest = memory_restore.skip_lost(c)  # those kept in memory only whose every copy of some rank is gone
    if latest is None:
        lifecycle.restore_read(c, a, None, None)
        return
    # Older ones, in case its manifest cannot be read: only those that every rank can still get.
    rest = [r.checkpoint_dir for r in sorted(c.book.state.checkpoints, key=lambda r: -r.seq)
            if r.checkpoint_dir != latest and memory_restore.restorable(c, r.checkpoint_dir)]
    candidates = (latest, *rest)
    c.ask_storage(lambda i: fx.ReadManifests(i, candidates),
                  partial(_restorable_read, a=a, asked=c.book.state.latest_checkpoint))


def _restorable_read(c: "ControllerCore", done: fx.ManifestsRead, a: AttemptState, asked: str) -> None:
    if c.attempt is not a:
        return
    if c.book.state.latest_checkpoint != asked:  # a commit landed meanwhile: read again
        read_restorable(c, a)
        return
    for read in done.reads:
        if read.newer is not None:
            lifecycle.give_up(c, read.newer)
            return
        if read.ranks is not None:
            lifecycle.restore_read(c, a, read.checkpoint_dir, set(read.ranks))
            return
        if read.unreadable is not None:
            # Not skipped: storage may be failing for now. Its workers fail and retry if it still is.
            log.warning("could not read the manifest of checkpoint %s (%s); restoring it all the same",
                        read.checkpoint_dir, read.unreadable)
            lifecycle.restore_read(c, a, read.checkpoint_dir, None)
            return
        fallback = c.book.skip_checkpoint(read.checkpoint_dir, read.skip or "unreadable", c.wall())
        log.warning("checkpoint %s cannot be restored (%s); using %s instead", read.checkpoint_dir, read.skip,
                    fallback or "no checkpoint")
    lifecycle.restore_read(c, a, None, None)


def finish_without_last_messages(c: "ControllerCore", a: AttemptState) -> None:
    unsaid = [f"{p.checkpoint_dir} of ranks {sorted(p.awaiting)}" for r in range(c.plan.world_size)
              for p in c.commits.awaiting_uploads_of(r) if min(p.awaiting) == r]
    log.warning("finishing without the last messages of ranks %s%s", sorted(set(range(c.plan.world_size)) - a.done),
                f"; asynchronous uploads never said they were done, and their files were not known when they began "
                f"(a staged save writes them later), so these checkpoints are not committed: {', '.join(unsaid)}"
                if unsaid else "")
    lifecycle.finish(c)
