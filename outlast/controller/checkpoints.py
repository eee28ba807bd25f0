"""The controller's writes of checkpoints to the run's history: commit, retention, what to restore.

A checkpoint is committed by its manifest. Nothing after the manifest (the run state,
deleting old checkpoints) can take the commit back, so a failure there is logged and
the ranks still hear "committed".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from outlast.controller.commit import PendingCheckpoint
from outlast.controller.file_merge import merge_and_note
from outlast.controller.retention import checkpoints_to_delete
from outlast.controller.runstate import RunBook
from outlast.protocol import messages as m
from outlast.storage.records import CorruptDocument

log = logging.getLogger("outlast.controller")


@dataclass(frozen=True)
class RetentionRule:
    num_to_keep: int | None
    score_attribute: str | None
    score_order: str


def commit(book: RunBook, pending: PendingCheckpoint, attempt: int, placement: dict[int, str],
           retention: RetentionRule, duplicate_files: str, wall: float) -> m.Committed | m.CommitFailed:
    """Write the manifest of a settled checkpoint; the answer its blocked ranks get."""
    try:
        if pending.missing_shards:
            raise ValueError(pending.missing_reason(placement))
        if pending.errors:
            raise ValueError("; ".join(f"rank {r}: {e}" for r, e in sorted(pending.errors.items())))
        files = merge_and_note(pending.files, duplicate_files, book, pending.checkpoint_dir, wall)
        book.commit_checkpoint(pending.checkpoint_dir, attempt, pending.index, sorted(pending.files), files,
                               pending.metrics, wall)
    except (ValueError, OSError) as e:
        log.error("checkpoint %s not committed (the latest committed one stays %s): %s",
                  pending.checkpoint_dir, book.state.latest_checkpoint, e)
        if pending.missing_shards:
            book.note_uncommitted(pending.checkpoint_dir, str(e), wall)
        return m.CommitFailed(index=pending.index, reason=str(e))
    apply_retention(book, retention)
    return m.Committed(index=pending.index, checkpoint_dir=pending.checkpoint_dir)


def apply_retention(book: RunBook, rule: RetentionRule) -> None:
    doomed = checkpoints_to_delete(book.state.checkpoints, rule.num_to_keep, rule.score_attribute, rule.score_order)
    if not doomed:
        return
    # The run state stops naming them first, so a crash in between leaves only garbage.
    book.forget_checkpoints({c.checkpoint_dir for c in doomed})
    for c in doomed:
        try:
            book.store.delete_checkpoint(c.checkpoint_dir)
        except OSError as e:
            log.warning("could not delete checkpoint %s, which CheckpointConfig(num_to_keep=%s) lets go (%s); "
                        "the run goes on, and the files stay until deleted by hand (grant the delete permission "
                        "on the storage to have them removed)", c.checkpoint_dir, rule.num_to_keep, e)


def restorable(book: RunBook, wall: float) -> str | None:
    """The latest committed checkpoint whose manifest is still readable; skip (and record) others.

    Only the manifest is read here; the workers check the files against it when they fetch them.
    A manifest that cannot be read for now (storage failing) is not skipped: the attempt restores it,
    and its workers fail and retry if it is still unreadable for them.
    """
    while (latest := book.state.latest_checkpoint) is not None:
        try:
            if book.store.read_manifest(latest) is not None:
                return latest
            reason = "its manifest is gone from storage"
        except CorruptDocument as e:
            reason = str(e)
        except OSError as e:
            log.warning("could not read the manifest of checkpoint %s (%s); restoring it all the same", latest, e)
            return latest
        fallback = book.skip_checkpoint(latest, reason, wall)
        log.warning("checkpoint %s cannot be restored (%s); using %s instead", latest, reason,
                    fallback or "no checkpoint")
    return None


def shard_holders(book: RunBook, restore: str | None) -> set[int] | None:
    if restore is None:
        return None
    try:
        manifest = book.store.read_manifest(restore)
    except (CorruptDocument, OSError):
        return None
    return set(manifest.ranks) if manifest is not None else None


def remove_uncommitted(book: RunBook) -> None:
    """Only while no worker of this run is alive: an upload in flight has no manifest yet either."""
    try:
        book.store.remove_uncommitted({c.checkpoint_dir for c in book.state.checkpoints})
    except OSError as e:
        log.warning("could not remove uncommitted checkpoint directories: %s", e)
