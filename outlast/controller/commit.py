"""When a reported checkpoint is complete, without a barrier between ranks.

Every rank calls `report()` the same number of times, so report number i is the same
logical checkpoint on every rank. A checkpoint at index i is whole once every rank
has made at least i + 1 reports: each rank that had files for it sent them with its
report i. The tracker only counts; the runtime writes the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from outlast.protocol.messages import FileEntry


@dataclass
class PendingCheckpoint:
    index: int
    checkpoint_dir: str
    files: dict[int, list[FileEntry]] = field(default_factory=dict)  # rank -> its files
    metrics: dict = field(default_factory=dict)
    awaiting: set[int] = field(default_factory=set)  # ranks whose asynchronous upload is still running
    waiting: set[int] = field(default_factory=set)  # ranks blocked in report() until the commit
    errors: dict[int, str] = field(default_factory=dict)  # rank -> why its upload failed


class CommitTracker:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.reports = [0] * world_size
        self._pending: dict[int, PendingCheckpoint] = {}
        # Rank 0's metrics of reports not yet made by every rank: a checkpoint's metrics are
        # rank 0's, even when rank 0 had no files for it. Keys only grow, so the oldest is first.
        self._rank0_metrics: dict[int, dict] = {}
        self._early_uploads: dict[tuple[int, int], tuple[list[FileEntry], str | None]] = {}

    def on_report(
        self, rank: int, index: int, checkpoint_dir: str | None, files: list[FileEntry], metrics: dict,
        upload_pending: bool = False,
    ) -> list[PendingCheckpoint]:
        """Record report `index` of `rank`; return the checkpoints that just became whole, oldest first."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"a report came from rank {rank}, outside the world of {self.world_size} ranks")
        if index != self.reports[rank]:
            raise ValueError(f"rank {rank} sent report {index}, expected {self.reports[rank]}")
        self.reports[rank] = index + 1
        if rank == 0 and self.world_size > 1:
            self._rank0_metrics[index] = metrics
        if checkpoint_dir is not None:
            pending = self._pending.get(index)
            if pending is None:
                pending = self._pending[index] = PendingCheckpoint(index, checkpoint_dir)
            if rank == 0 or not pending.metrics:
                pending.metrics = metrics
            if not upload_pending:
                pending.files[rank] = list(files)
                pending.waiting.add(rank)
            elif (rank, index) in self._early_uploads:
                self._record_upload(pending, rank, *self._early_uploads.pop((rank, index)))
            else:
                pending.awaiting.add(rank)
        return self._ready()

    def on_upload_done(
        self, rank: int, index: int, checkpoint_dir: str, files: list[FileEntry], error: str | None
    ) -> list[PendingCheckpoint]:
        pending = self._pending.get(index)
        if pending is None or rank not in pending.awaiting:
            self._early_uploads[(rank, index)] = (list(files), error)  # its Report is still on the way
            return []
        pending.awaiting.discard(rank)
        self._record_upload(pending, rank, files, error)
        return self._ready()

    @staticmethod
    def _record_upload(pending: PendingCheckpoint, rank: int, files: list[FileEntry], error: str | None) -> None:
        if error is not None:
            pending.errors[rank] = error
        else:
            pending.files[rank] = list(files)

    def _ready(self) -> list[PendingCheckpoint]:
        done_below = min(self.reports)
        out = []
        for i in sorted(self._pending):  # strictly in order: a later checkpoint never overtakes an earlier one
            if i >= done_below or self._pending[i].awaiting:
                break
            out.append(self._pending.pop(i))
        for p in out:
            p.metrics = self._rank0_metrics.get(p.index, p.metrics)
        oldest_kept = min([done_below, *self._pending])
        while self._rank0_metrics and next(iter(self._rank0_metrics)) < oldest_kept:
            del self._rank0_metrics[next(iter(self._rank0_metrics))]
        return out

    def waiting_for(self, index: int) -> list[int]:
        """Ranks that have not yet made report `index`."""
        return [r for r, n in enumerate(self.reports) if n <= index]
