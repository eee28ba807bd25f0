"""The commit machine: from a checkpoint the reports settled to its manifest, its copies in the nodes' memory
and, for a notice's checkpoint through a peer, its upload from there.

`Commits.step(event, view, now)` is the one entry point. It owns its state (the commits on
their way, the copies being made, the requests in flight with a typed record each), reads the
core only through the frozen `view`, and returns effects and outcomes in order; the core
carries out the effects and applies the outcomes (`controller/commit_steps.py`).

1. A settled checkpoint (`commit.py`) gets its manifest written (`WriteManifest`); files that
   ranks wrote differently are read back first (`ReadChecksums`, `file_merge.py` decides).
   A checkpoint kept in memory (`holds.py`) is written once two nodes hold every rank's files.
2. Once storage says the manifest is written, the checkpoint is committed: the history names
   it (`RecordCommit`), and its ranks may hear it (`CommitDone`), once their nodes' copies answered.

Nothing after the manifest can take the commit back. A commit that cannot be made is refused
(`CommitRefused`), saying why.
"""

from __future__ import annotations

from typing import Callable

from outlast.controller import effects as fx
from outlast.controller.commit import PendingCheckpoint
from outlast.controller.commits.events import (
    CommitDone, CommitRefused, Event, HeadLost, NoteOnce, Out, RecordCommit, Reported, RunEnded, Settled, Timers,
    UploadsChecked, UploadsEnded, UploadsToCheck,
)
from outlast.controller.commits.holds import Holds
from outlast.controller.commits.peer import PeerUploads
from outlast.controller.commits.pending import (
    Asks, ChecksumRead, Committing, DurableWrite, Free, Holding, LocalCopy, ManifestWrite, MemoryCommit, MemoryCopy,
    Replica, Told, Upload, UploadCheck,
)
from outlast.controller.commits.view import MEMORY, STORAGE, View
from outlast.controller.file_merge import DuplicateFiles, MergedFiles, merge_files, settle
from outlast.protocol.messages import FileEntry
from outlast.storage.records import Manifest


class Commits:
    def __init__(self, ids: fx.EffectIds) -> None:
        self._asks = Asks(ids)
        self.holds = Holds(self._asks)
        self.peer = PeerUploads(self._asks)
        self._local_dirs: dict[tuple[int, int, int], str] = {}  # (attempt, report, rank) -> the rank's own directory
        self._stored: set[tuple[int, int, int]] = set()  # of those, the ones that are the checkpoint's in storage
        self._events: dict[type, Callable[..., None]] = {  # by the event's type
            Settled: self._begin, Reported: self._reported, UploadsToCheck: self._check_uploads,
            Timers: self._timers, RunEnded: self._run_ended,
            fx.ManifestWritten: self._answered, fx.ChecksumsRead: self._answered, fx.UploadsFound: self._answered,
            fx.StorageFailed: self._failed, fx.TierAnswered: self._tier_answered,
        }
        self._answers: dict[type, Callable[..., None]] = {  # storage's answers, by what was asked
            ManifestWrite: self._manifest_written, DurableWrite: self.peer.on_durable,
            ChecksumRead: self._checksums_read, UploadCheck: self._uploads_checked,
        }
        self._tiers: dict[type, Callable[..., None]] = {  # the tiers' answers, by what was asked
            LocalCopy: self.holds.on_local, Replica: self.holds.on_replica, MemoryCopy: self._memory_answered,
            Told: self._told, Upload: self.peer.on_upload, Free: self.holds.on_freed,
        }

    # ---- the one entry point ----------------------------------------------------------

    def step(self, event: Event, view: View, now: float) -> list[Out]:
        out: list[Out] = []
        self._events[type(event)](event, view, now, out)
        return out

    # ---- what the core asks of it ------------------------------------------------------

    def in_progress(self) -> set[str]:
        """Checkpoints whose commit has begun and not ended, or whose uploads storage is asked about: their
        directories are not garbage."""
        return {x.pending.checkpoint_dir for x in self._asks.of(ChecksumRead)} \
            | {x.committing.manifest.checkpoint_dir for x in self._asks.of(ManifestWrite)} \
            | {x.checkpoint_dir for x in self._asks.of(UploadCheck)} | self.holds.pending_in_memory() \
            | self.peer.in_flight()

    def unsettled_below(self, attempt: int, index: int) -> bool:
        """Whether a checkpoint of `attempt` among reports below `index` is being committed still."""
        return any(x.pending.index < index for x in self._asks.of(ChecksumRead)) \
            or any(x.committing.attempt == attempt and x.committing.pending.index < index
                   for x in self._asks.of(ManifestWrite)) \
            or any(h.attempt == attempt and h.on_all is not None and h.index < index for h in self.holds.holds.values())

    @property
    def checking_uploads(self) -> bool:
        """Storage is asked whether the files of an upload whose done message never came are there."""
        return bool(self._asks.of(UploadCheck))

    @property
    def uploading_from_memory(self) -> bool:
        """A drain's checkpoint is still going from a peer's memory to storage."""
        return bool(self.peer.durable)

    def peer_rate(self, node_id: str) -> float:
        """Bytes per second of the node's last replica to a peer; 0 until one is measured."""
        return self.holds.peer_bps.get(node_id, 0.0)

    def waits_for_frees(self, now: float) -> bool:
        """The run's end asked nodes to free its copies, and the close still waits for their answers."""
        return bool(self.holds.freeing) and now < self.holds.free_by

    # ---- events ------------------------------------------------------------------------

    def _reported(self, e: Reported, view: View, now: float, out: list[Out]) -> None:
        if e.local_dir:
            self._local_dirs[(e.attempt, e.index, e.rank)] = e.local_dir
            if e.stored:
                self._stored.add((e.attempt, e.index, e.rank))
        if e.through_peer:
            self.peer.through_peer.add((e.attempt, e.index))

    def _begin(self, e: Settled, view: View, now: float, out: list[Out]) -> None:
        """Phase one: check the settled checkpoint, and hand its manifest to storage."""
        pending, attempt = e.pending, view.attempt
        assert attempt is not None
        if pending.missing_shards:
            out.append(CommitRefused(pending, attempt, pending.missing_reason(view.placement)))
            return
        if pending.errors:
            why = "; ".join(f"rank {r}: {x}" for r, x in sorted(pending.errors.items()))
            out.append(CommitRefused(pending, attempt, why))
            return
        try:
            merged = merge_files(pending.files, DuplicateFiles(view.duplicate_files))
        except ValueError as x:
            out.append(CommitRefused(pending, attempt, str(x)))
            return
        if not merged.conflicts:
            self._commit_files(view, pending, attempt, merged.files, out)
            return
        if view.level == MEMORY or self.peer.is_through_peer(attempt, pending.index):
            # Nothing is in storage to read back: every rank's copy is in its own node's memory, so the
            # lowest rank's (rank 0's, where it wrote one) is the one kept.
            kept = settle(merged, {x.path: x.entries[0].checksum for x in merged.conflicts})
            self._say_kept(pending, kept, out)
            self._commit_files(view, pending, attempt, kept.files, out)
            return
        paths = tuple((conflict.path, conflict.entries[0].checksum[0]) for conflict in merged.conflicts)
        self._asks.store(out, lambda i: fx.ReadChecksums(i, pending.checkpoint_dir, paths),
                         ChecksumRead(pending, attempt, merged))

    def _checksums_read(self, ask: ChecksumRead, done: fx.ChecksumsRead, view: View, out: list[Out]) -> None:
        try:
            merged = settle(ask.merged, done.checksums)
        except ValueError as x:
            out.append(CommitRefused(ask.pending, ask.attempt, str(x)))
            return
        self._say_kept(ask.pending, merged, out)
        self._commit_files(view, ask.pending, ask.attempt, merged.files, out)

    @staticmethod
    def _say_kept(pending: PendingCheckpoint, merged: MergedFiles, out: list[Out]) -> None:
        kept = ", ".join(f"{conflict.path!r} from rank {conflict.kept}" for conflict in merged.conflicts)
        out.append(NoteOnce(merged.describe(),
                        warn=f"checkpoint {pending.checkpoint_dir}: {merged.describe()} (this one kept {kept})",
                        debug=f"checkpoint {pending.checkpoint_dir} kept {kept}"))

    def _next_seq(self, view: View) -> int:
        return max([r.seq for r in view.records] + [x.committing.manifest.seq for x in self._asks.of(ManifestWrite)]
                   + [h.seq for h in self.holds.holds.values()], default=0) + 1

    def _local_dirs_of(self, pending: PendingCheckpoint, attempt: int) -> tuple[dict[int, str], set[int]]:
        """The ranks' own directories of this checkpoint, as their reports named them (taken: used once), and the
        ranks whose directory is the checkpoint's in storage."""
        out, stored = {}, set()
        for rank in pending.files:
            where = self._local_dirs.pop((attempt, pending.index, rank), "")
            if where:
                out[rank] = where
            if (attempt, pending.index, rank) in self._stored:
                stored.add(rank)
        for key in [k for k in self._local_dirs if k[0] != attempt or k[1] <= pending.index]:
            del self._local_dirs[key]
        self._stored = {k for k in self._stored if k[0] == attempt and k[1] > pending.index}
        return out, stored

    def _commit_files(self, view: View, pending: PendingCheckpoint, attempt: int, files: list[FileEntry],
                      out: list[Out]) -> None:
        """The checked files' commit, at the run's level: the manifest now (and copies in memory beside it),
        or once two nodes keep every rank's files in memory (`holds.py`)."""
        seq = self._next_seq(view)
        local_dirs, stored = self._local_dirs_of(pending, attempt)
        through_peer = self.peer.is_through_peer(attempt, pending.index)  # a notice's: storage follows
        if view.level != MEMORY and not through_peer:
            self._write_manifest(view, pending, attempt, files, seq, out)
            self.holds.keep_beside(view, pending, attempt, seq, local_dirs, out, stored=stored, stored_files=files)
            return
        stuck = self.holds.stuck_without_head(view)
        if stuck is not None:  # every later attempt would fail its commits the same way: the run cannot go on
            out.append(HeadLost(attempt, stuck))
            return
        commit = MemoryCommit(pending, attempt, files, seq, through_peer)
        begun = self.holds.commit_in_memory(view, commit, local_dirs, out)
        if isinstance(begun, str):
            out.append(CommitRefused(pending, attempt, begun))
        elif not begun.waiting:  # no rank has files to keep
            self._held(view, begun, commit, out)

    def _memory_answered(self, ask: MemoryCopy, e: fx.TierAnswered, view: View, out: list[Out]) -> None:
        commit = self.holds.on_memory(ask, e)
        if commit is not None:
            self._held(view, ask.holding, commit, out)

    def _held(self, view: View, h: Holding, commit: MemoryCommit, out: list[Out]) -> None:
        """Every rank's node answered: committed in memory, or refused."""
        pending = commit.pending
        ok, why = self.holds.in_memory(view, h)
        out.append(UploadsEnded(pending.index, tuple(pending.files)))  # the copies to the peers have answered
        if ok and commit.through_peer:
            self.peer.upload_after(view, h)
        if not ok:
            self.holds.holds.pop(h.checkpoint_dir, None)
            out.append(CommitRefused(pending, commit.attempt, f"not committed in memory: {why}"))
            return
        self._write_manifest(view, pending, commit.attempt, commit.files, commit.seq, out,
                             memory={r: sorted(ns) for r, ns in h.holders.items()}, durable=False)

    def _write_manifest(self, view: View, pending: PendingCheckpoint, attempt: int, files: list[FileEntry], seq: int,
                        out: list[Out], memory: dict[int, list[str]] | None = None, durable: bool = True) -> None:
        """`memory`: rank -> the nodes that keep its files, for a checkpoint committed in memory."""
        now = view.wall
        nodes = sorted({n for ns in (memory or {}).values() for n in ns})
        manifest = Manifest(checkpoint_dir=pending.checkpoint_dir, seq=seq, attempt=attempt,
                            report_index=pending.index, committed_at=now, ranks=sorted(pending.files), files=files,
                            metrics=pending.metrics, memory=nodes, memory_at=now if memory else None,
                            durable=durable, memory_ranks=dict(memory or {}),
                            data_positions=dict(pending.data_positions))
        self._asks.store(out, lambda i: fx.WriteManifest(i, manifest), ManifestWrite(Committing(pending, attempt,
                                                                                                manifest)))

    def _manifest_written(self, ask: ManifestWrite, done: fx.ManifestWritten, view: View, out: list[Out]) -> None:
        """Phase two: committed. A drain's checkpoint in a peer's memory begins its uploads, the history names
        it, and its ranks hear it, once their nodes' copies answered; then the nodes whose copy comes from
        storage's own directory are asked for it."""
        committing = ask.committing
        self.peer.after_commit(view, committing.manifest, out)
        out.append(RecordCommit(committing.manifest))
        if not self.holds.hold_commit_back(view, committing.pending.checkpoint_dir, committing, out):
            out.append(CommitDone(committing.pending, committing.attempt))
        self.holds.copy_from_storage(view, committing.pending.checkpoint_dir, out)  # after the ranks are told

    def _check_uploads(self, e: UploadsToCheck, view: View, now: float, out: list[Out]) -> None:
        """`e.rank` exited cleanly, and so every upload it began has ended; those whose UploadDone has not come
        may have lost it at the exit (the upload thread's socket). Storage says whether their files are there."""
        asked = {(x.rank, x.index) for x in self._asks.of(UploadCheck) if x.attempt == e.attempt}
        for index, checkpoint_dir, files in e.uploads:
            if not files or (e.rank, index) in asked:  # a staged save writes its files after the report
                continue
            self._asks.store(out, lambda i: fx.CheckUploads(i, checkpoint_dir, files),  # noqa: B023 - called at once
                             UploadCheck(e.attempt, e.rank, index, checkpoint_dir))

    def _uploads_checked(self, ask: UploadCheck, found: fx.UploadsFound, view: View, out: list[Out]) -> None:
        out.append(UploadsChecked(ask.attempt, ask.rank, ask.index, ask.checkpoint_dir, found.files, found.missing))

    def _timers(self, e: Timers, view: View, now: float, out: list[Out]) -> None:
        self.peer.on_timers(view, out)

    def _told(self, ask: Told, e: fx.TierAnswered, view: View, out: list[Out]) -> None:
        """A node told its checkpoint is committed: its answer changes nothing."""

    def _run_ended(self, e: RunEnded, view: View, now: float, out: list[Out]) -> None:
        """A "storage" run that ends with every checkpoint durable frees its copies in memory on every node that
        holds one: else each node's copy of its newest committed checkpoint, which the budget never evicts, would
        take that node's memory for good. A "memory" run's copies are its only ones: they stay."""
        records = view.records
        if view.level != STORAGE or not records or not all(r.durable for r in records) or self.peer.durable:
            return
        nodes = {n for r in records for n in r.memory} | {n for h in self.holds.holds.values()
                                                           for ns in h.holders.values() for n in ns}
        self.holds.free(view, nodes, now, out)

    # ---- answers -----------------------------------------------------------------------

    def _answered(self, done: fx.StorageDone, view: View, now: float, out: list[Out]) -> None:
        ask = self._asks.storage.pop(done.id, None)
        if ask is not None:
            self._answers[type(ask)](ask, done, view, out)

    def _failed(self, failed: fx.StorageFailed, view: View, now: float, out: list[Out]) -> None:
        """Storage still failed after its retries (the core says so, and ends the run where it must)."""
        ask = self._asks.storage.pop(failed.id, None)
        said = f"storage failed {failed.what}: {failed.error}"
        if isinstance(ask, ManifestWrite):
            out.append(CommitRefused(ask.committing.pending, ask.committing.attempt, said))
        elif isinstance(ask, UploadCheck):  # not a write: the checkpoint is not committed, the run goes on
            out.append(UploadsChecked(ask.attempt, ask.rank, ask.index, ask.checkpoint_dir, (), (said,)))
        elif isinstance(ask, DurableWrite):
            self.peer.on_durable_failed(ask)

    def _tier_answered(self, e: fx.TierAnswered, view: View, now: float, out: list[Out]) -> None:
        ask = self._asks.tiers.pop(e.id, None)
        if ask is not None:
            self._tiers[type(ask)](ask, e, view, out)
