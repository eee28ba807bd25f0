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


class CommitTracker:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.reports = [0] * world_size
        self._pending: dict[int, PendingCheckpoint] = {}
        # Rank 0's metrics of reports not yet made by every rank: a checkpoint's metrics are
        # rank 0's, even when rank 0 had no files for it. Keys only grow, so the oldest is first.
        self._rank0_metrics: dict[int, dict] = {}

    def on_report(
        self, rank: int, index: int, checkpoint_dir: str | None, files: list[FileEntry], metrics: dict
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
            pending.files[rank] = list(files)
            if rank == 0 or not pending.metrics:
                pending.metrics = metrics
        done_below = min(self.reports)
        ready = sorted(i for i in self._pending if i < done_below)
        out = [self._pending.pop(i) for i in ready]
        for p in out:
            p.metrics = self._rank0_metrics.get(p.index, p.metrics)
        while self._rank0_metrics and next(iter(self._rank0_metrics)) < done_below:
            del self._rank0_metrics[next(iter(self._rank0_metrics))]
        return out

    def waiting_for(self, index: int) -> list[int]:
        """Ranks that have not yet made report `index`."""
        return [r for r, n in enumerate(self.reports) if n <= index]
