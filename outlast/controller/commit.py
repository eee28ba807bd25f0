"""When a reported checkpoint is complete, without a barrier between ranks.

Every rank calls `report()` the same number of times, so report number i is the same
logical checkpoint on every rank. A checkpoint at index i is whole once every rank
has made at least i + 1 reports: each rank that had files for it sent them with its
report i. The tracker only counts; the runtime writes the manifest.

Lost ranks (`relax_collectives_on_preemption`). After `lose_ranks`, the tracker stops
waiting for those ranks: checkpoint i is settled once every surviving rank has made
i + 1 reports and no surviving rank's upload is still running. It is whole unless a
lost rank held a shard of it that never arrived; then it has `missing_shards` and is
never committed. Which ranks hold a shard of checkpoint i:

(a) a rank that reported index i with a checkpoint directory (its files came with the
    report, or its upload finished, failed, or was still running when it was lost:
    the last of these is a missing shard);
(b) a lost rank that never reported index i, when it contributed files to the most
    recent earlier checkpoint this tracker saw whole, or, before any, to the restored
    checkpoint whose contributing ranks seeded `shard_holders`. The tracker cannot
    see what the rank would have written, so it assumes the same layout as last time;
(c) with no such history, a lost rank that never reported index i when two or more
    ranks contributed to checkpoint i: a sharded pattern, where every rank is assumed
    to write a part. When one rank alone contributed, the pattern is the replicated
    one (rank 0 saves), and a lost rank is assumed to hold nothing.

Reports and uploads arriving from a rank after its loss are stragglers and are ignored:
the decision about what that rank delivered was made when it was lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from outlast.protocol.messages import FileEntry


@dataclass
class PendingCheckpoint:
    index: int
    checkpoint_dir: str
    files: dict[int, list[FileEntry]] = field(default_factory=dict)  # rank -> its files
    metrics: dict[str, Any] = field(default_factory=dict)
    awaiting: set[int] = field(default_factory=set)  # ranks whose asynchronous upload is still running
    began_with: dict[int, list[FileEntry]] = field(default_factory=dict)  # rank -> what its upload began with
    waiting: set[int] = field(default_factory=set)  # ranks blocked in report() until the commit
    errors: dict[int, str] = field(default_factory=dict)  # rank -> why its upload failed
    # Lost ranks whose shard never arrived. Each also has an entry in `errors`, so a commit
    # path that only refuses checkpoints with errors never commits one missing a shard.
    missing_shards: list[int] = field(default_factory=list)
    data_positions: dict[int, str] = field(default_factory=dict)  # rank -> where it was in its data

    def missing_reason(self, node_of: Mapping[int, str] | None = None) -> str:
        """Why this checkpoint is never committed; `node_of` (rank -> node id) names where the ranks were."""
        nodes = sorted({node_of[r] for r in self.missing_shards if r in node_of}) if node_of else []
        where = f"lost with node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}" if nodes \
            else "lost before delivering them"
        return f"checkpoint {self.checkpoint_dir} is missing the shards of ranks {self.missing_shards} ({where})"


@dataclass(frozen=True)
class LossOutcome:
    """The checkpoints that losing ranks settled, oldest first, as `on_report` returns them."""

    settled: list[PendingCheckpoint]

    @property
    def whole(self) -> list[PendingCheckpoint]:
        return [p for p in self.settled if not p.missing_shards]

    @property
    def incomplete(self) -> list[PendingCheckpoint]:
        return [p for p in self.settled if p.missing_shards]


class CommitTracker:
    def __init__(self, world_size: int, shard_holders: Iterable[int] | None = None) -> None:
        self.world_size = world_size
        self.reports = [0] * world_size
        # How many surviving ranks have made each number of reports, and the least of those numbers:
        # counts only grow, so the least moves forward and each report costs O(1), not O(ranks).
        # Keyed by float as the least is infinite once no rank survives.
        self._made: dict[float, int] = {0: world_size} if world_size else {}
        self._least: float = 0 if world_size else float("inf")
        self.lost: set[int] = set()
        self.absent: set[int] = set()  # replaced by live recovery, until the replacement's first report (`replaced`)
        self.ever_replaced: set[int] = set()
        self.added: set[int] = set()  # added by a grow, until their first report: they held no earlier checkpoint
        self._pending: dict[int, PendingCheckpoint] = {}
        # Ranks that contributed to the last whole checkpoint: rule (b) of the module docstring.
        self._shard_holders: set[int] | None = set(shard_holders) if shard_holders is not None else None
        # A checkpoint's metrics are the lead rank's, even when the lead had no files for it: rank 0,
        # or after its loss the lowest surviving rank. Kept for reports not yet made by every
        # surviving rank; keys only grow, so the oldest is first.
        self._lead: int | None = 0
        self._lead_metrics: dict[int, dict[str, Any]] = {}
        self._early_uploads: dict[tuple[int, int], tuple[str, list[FileEntry], str | None]] = {}
        self._positions: dict[int, dict[int, str]] = {}  # report index -> rank -> data position, until settled
        self._last_position: dict[int, str] = {}  # rank -> the data position of its latest report
        # Live recovery: rank -> the generation from which a shrink left it out, and report index -> the newest
        # generation a rank reported it in. A report of that generation or a later one is no concern of the rank.
        self._left: dict[int, int] = {}
        self._generation: dict[int, int] = {}

    def replaced(self, rank: int) -> list[PendingCheckpoint]:
        """Live recovery: `rank`'s process died and a replacement takes its place. The steps every rank committed
        that it did not report yet, it never will (its replacement reports from the count of the rank whose state
        it took, `skip_to`), so until that first report no checkpoint waits for it, and a shard it held and did not
        report is missing, as a lost rank's. Returns the checkpoints that settled because of it, oldest first.

        Without it, a rank that died between a committed step and its report held up every checkpoint from that
        step on, and a survivor in a synchronous report() of one of them waited for its commit, never to send the
        state the replacement waits for."""
        if not 0 <= rank < self.world_size or rank in self.lost or rank in self.absent:
            return []
        self.absent.add(rank)
        self.ever_replaced.add(rank)
        self._made[self.reports[rank]] -= 1
        self._advance_least()
        return self._ready()

    def skip_to(self, rank: int, index: int) -> None:
        """Live recovery: `rank`'s replacement reports from `index` on, the count of the rank whose state it took.
        Its predecessor may have died before reporting a step every rank committed; its reports between never come."""
        if not 0 <= rank < self.world_size or rank in self.lost:
            return
        if rank in self.absent:  # counted again, from its replacement's first report
            self.absent.discard(rank)
            self.added.discard(rank)
            self.reports[rank] = max(index, self.reports[rank])
            self._made[self.reports[rank]] = self._made.get(self.reports[rank], 0) + 1
            self._least = min(self._least, self.reports[rank])
            self._advance_least()
        elif index > self.reports[rank]:
            # Moved in the count of ranks by reports made too: the least count is what settles a checkpoint.
            self._made[self.reports[rank]] -= 1
            self._made[index] = self._made.get(index, 0) + 1
            self.reports[rank] = index
            self._advance_least()

    def grow(self, world_size: int) -> None:
        """Live recovery: ranks added to the attempt (an elastic grow). Absent, as a replaced rank is, until their
        first report says where they take up the count (`skip_to`): they take it from a rank that held the state,
        and never make the reports it made before they joined, nor held a shard of those checkpoints (`added`).
        Counted as having made the least reports, a rank in a synchronous report() of a checkpoint made between the
        grow and the join waited for the added rank's report of it, never to send the state that rank waits for."""
        for rank in range(self.world_size, world_size):
            self.reports.append(0)
            self.absent.add(rank)
            self.added.add(rank)
        self.world_size = max(self.world_size, world_size)
        self._advance_least()

    def lose_uploads(self, rank: int) -> list[PendingCheckpoint]:
        """Live recovery: `rank` died with its asynchronous uploads running; they never say they are done."""
        for pending in self._pending.values():
            if rank in pending.awaiting:
                pending.awaiting.discard(rank)
                self._mark_missing(pending, rank, "died while uploading its shard")
        return self._ready()

    def on_report(
        self, rank: int, index: int, checkpoint_dir: str | None, files: list[FileEntry], metrics: dict[str, Any],
        upload_pending: bool = False, upload_files: list[FileEntry] | None = None, data_position: str = "",
        generation: int = 0,
    ) -> list[PendingCheckpoint]:
        """Record report `index` of `rank`; return the checkpoints that just settled, oldest first.

        Before any `lose_ranks` these are all whole; after, some may have `missing_shards`.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"a report came from rank {rank}, outside the world of {self.world_size} ranks")
        if rank in self.lost:
            return []
        if rank in self.absent or (rank in self.ever_replaced and index > self.reports[rank]):
            # A replaced rank's report: its replacement's first (it counts again from there). A dead predecessor's,
            # read after its death, is not counted while the rank is absent (`on_workers.on_report`).
            self.skip_to(rank, index)
        if index != self.reports[rank]:
            raise ValueError(f"rank {rank} sent report {index}, expected {self.reports[rank]}")
        self.reports[rank] = index + 1
        self._count_report(index)
        if generation:
            self._generation[index] = max(generation, self._generation.get(index, 0))
        if rank == self._lead and self.world_size > 1:
            # setdefault: after rank 0's loss, what rank 0 reported before it still wins.
            self._lead_metrics.setdefault(index, metrics)
        if data_position:
            # Every rank's, checkpoint or not (often only rank 0 has files): the manifest keeps them all.
            self._positions.setdefault(index, {})[rank] = data_position
            self._last_position[rank] = data_position
        if checkpoint_dir is not None:
            pending = self._pending.get(index)
            if pending is None:
                pending = self._pending[index] = PendingCheckpoint(index, checkpoint_dir)
            elif checkpoint_dir != pending.checkpoint_dir:
                pending.errors[rank] = (
                    f"rank {rank} stored its files under {checkpoint_dir!r}, another rank under "
                    f"{pending.checkpoint_dir!r}: pass the same checkpoint_dir_name on every rank that reports files")
            if rank == 0 or not pending.metrics:
                pending.metrics = metrics
            if not upload_pending:
                pending.files[rank] = list(files)
                pending.waiting.add(rank)
            elif (rank, index) in self._early_uploads:
                _, early_files, error = self._early_uploads.pop((rank, index))
                self._record_upload(pending, rank, early_files, error)
            else:
                pending.awaiting.add(rank)
                pending.began_with[rank] = list(upload_files or [])
        return self._ready()

    def awaiting_uploads_of(self, rank: int) -> list[PendingCheckpoint]:
        """The checkpoints whose asynchronous upload by `rank` has not said it is done, oldest first."""
        return [self._pending[i] for i in sorted(self._pending) if rank in self._pending[i].awaiting]

    def unsettled_below(self, index: int) -> bool:
        """Some checkpoint reported below `index` still waits for a rank's report or upload."""
        return any(i < index for i in self._pending)

    @property
    def uploads_in_flight(self) -> bool:
        """Some rank reported a checkpoint whose asynchronous upload has not said it is done."""
        return any(p.awaiting for p in self._pending.values())

    def on_upload_done(
        self, rank: int, index: int, checkpoint_dir: str, files: list[FileEntry], error: str | None
    ) -> list[PendingCheckpoint]:
        if rank in self.lost:
            return []
        pending = self._pending.get(index)
        if pending is None or rank not in pending.awaiting:
            self._early_uploads[(rank, index)] = (checkpoint_dir, list(files), error)  # its Report is on the way
            return []
        pending.awaiting.discard(rank)
        self._record_upload(pending, rank, files, error)
        return self._ready()

    def lose_ranks(self, ranks: Iterable[int], left_from: int | None = None) -> LossOutcome:
        """Stop waiting for `ranks` (their node is gone); return the checkpoints that settled because of it.
        `left_from`: a live shrink's generation, from which the group goes on without them: a report made in it or
        later is the smaller world's, with no shard and no data position of theirs."""
        ranks = set(ranks)
        if left_from is not None:
            self._left.update(dict.fromkeys(ranks, left_from))
        outside = sorted(r for r in ranks if not 0 <= r < self.world_size)
        if outside:
            raise ValueError(f"cannot lose ranks {outside}, outside the world of {self.world_size} ranks")
        new = ranks - self.lost
        self.lost |= new
        for rank in new - self.absent:  # an absent rank is out of the count already
            self._made[self.reports[rank]] -= 1
        self.absent -= new
        self._advance_least()
        for (rank, index) in [k for k in self._early_uploads if k[0] in new]:
            # Its upload finished but its Report never will arrive: the shard is there all the same.
            checkpoint_dir, files, error = self._early_uploads.pop((rank, index))
            pending = self._pending.get(index)
            if pending is None:
                pending = self._pending[index] = PendingCheckpoint(index, checkpoint_dir)
            self._record_upload(pending, rank, files, error)
        for pending in self._pending.values():
            for rank in sorted(pending.awaiting & new):
                pending.awaiting.discard(rank)
                self._mark_missing(pending, rank, "lost while uploading its shard")
        if self._lead in new:
            self._lead = min(self._survivors(), default=None)
        return LossOutcome(self._ready())

    def waiting_for(self, index: int) -> list[int]:
        """Surviving ranks that have not yet made report `index`."""
        return [r for r, n in enumerate(self.reports) if n <= index and r not in self.lost]

    def _count_report(self, made_before: int) -> None:
        self._made[made_before] -= 1
        self._made[made_before + 1] = self._made.get(made_before + 1, 0) + 1
        self._advance_least()

    def _advance_least(self) -> None:
        while self._made and self._made.get(self._least, 0) == 0:
            self._made.pop(self._least, None)
            self._least += 1
        if not self._made:
            self._least = float("inf")

    def _left_before(self, rank: int, index: int) -> bool:
        """Whether a live shrink left `rank` out before report `index` was made (in the generation it was made in)."""
        return rank in self._left and self._generation.get(index, 0) >= self._left[rank]

    def _survivors(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.lost]

    @staticmethod
    def _record_upload(pending: PendingCheckpoint, rank: int, files: list[FileEntry], error: str | None) -> None:
        if error is not None:
            pending.errors[rank] = error
        else:
            pending.files[rank] = list(files)

    @staticmethod
    def _mark_missing(pending: PendingCheckpoint, rank: int, why: str) -> None:
        pending.missing_shards = sorted({*pending.missing_shards, rank})
        pending.errors[rank] = why

    def _holds_unreported_shard(self, pending: PendingCheckpoint, rank: int) -> bool:
        """Rules (b) and (c) of the module docstring, for a lost rank that never reported this index."""
        if self._shard_holders is not None:
            return rank in self._shard_holders
        contributors = set(pending.files) | set(pending.errors) | pending.awaiting
        return len(contributors) >= 2

    def _ready(self) -> list[PendingCheckpoint]:
        done_below = self._least
        out = []
        for i in sorted(self._pending):  # strictly in order: a later checkpoint never overtakes an earlier one
            pending = self._pending[i]
            if i >= done_below or pending.awaiting:
                break
            unreported = [r for r in sorted(self.lost | self.absent - self.added)
                          if self.reports[r] <= i and r not in pending.files and r not in pending.errors
                          and not self._left_before(r, i)]
            for rank in [r for r in unreported if self._holds_unreported_shard(pending, r)]:
                self._mark_missing(pending, rank, "lost before reporting its shard")
            if not pending.missing_shards:
                # Settled in order, so this is the history rule (b) needs for every later checkpoint.
                self._shard_holders = set(pending.files) | set(pending.errors)
            out.append(self._pending.pop(i))
        for p in out:
            p.metrics = self._lead_metrics.get(p.index, p.metrics)
            p.data_positions = self._positions.pop(p.index, {})
            for rank in self.lost - set(p.data_positions):
                # Lost before it made this report: where it was at its last one. What it read since was never
                # reported, so it is read again. Not in a report of a group that shrank without it: the ranks left
                # split what it had not read between them.
                if rank in self._last_position and not self._left_before(rank, p.index):
                    p.data_positions[rank] = self._last_position[rank]
            self._generation.pop(p.index, None)
        oldest_kept = min([done_below, *self._pending])
        while self._lead_metrics and next(iter(self._lead_metrics)) < oldest_kept:
            del self._lead_metrics[next(iter(self._lead_metrics))]
        for index in [i for i in self._positions if i < oldest_kept]:
            del self._positions[index]  # a report without a checkpoint: nothing keeps its positions
        for index in [i for i in self._generation if i < oldest_kept]:
            del self._generation[index]
        return out
