"""One rank's part of a dataset, read block by block, with a position it can report and resume from.

The blocks of an epoch are dealt to the ranks in an order set by the epoch and the seed: rank r of n
takes every n-th block of that order, and reads no other. A walk holds at most the block being read
and the rows of the one before that did not fill a batch. `ShardPosition` is where the next batch starts;
`split_rest` deals the rest of an epoch again across a new number of ranks, so that every row of the
epoch is still read exactly once.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from outlast.data.batches import check_format, to_batch

if TYPE_CHECKING:
    from outlast.data.dataset import Dataset

Piece = tuple[int, int]  # (block id in the dataset, first row of that block to read)


@dataclass(frozen=True)
class ShardPosition:
    """Where a shard's next batch starts: `block` is an index into the epoch's plan (the pieces this rank
    reads), `row` the row of that block (after the dataset's transforms). `plan` is None for the plan
    that rank, world_size, epoch and seed give, or the pieces dealt by `split_rest`."""

    epoch: int
    block: int
    row: int
    seed: int | None
    rank: int
    world_size: int
    plan: tuple[Piece, ...] | None = None


def block_order(num_blocks: int, epoch: int, seed: int | None) -> list[int]:
    """The order of the blocks in an epoch: as read, or a permutation set by (seed, epoch)."""
    order = list(range(num_blocks))
    if seed is not None:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def dealt(num_blocks: int, rank: int, world_size: int, epoch: int, seed: int | None) -> tuple[Piece, ...]:
    return tuple((b, 0) for b in block_order(num_blocks, epoch, seed)[rank::world_size])


def split_rest(positions: Sequence[ShardPosition], world_size: int, num_blocks: int) -> list[ShardPosition]:
    """The rest of an epoch, from every old rank's position, dealt to `world_size` new ranks (one position
    each, to pass to `Shard.resume`). Raises when the positions are not one epoch of one world."""
    if not positions:
        raise ValueError("split_rest: give the position of every rank of the old world")
    old = positions[0]
    ranks = sorted(p.rank for p in positions)
    if ranks != list(range(old.world_size)) or any(
            (p.epoch, p.seed, p.world_size) != (old.epoch, old.seed, old.world_size) for p in positions):
        raise ValueError(f"split_rest: the positions must be one per rank 0..{old.world_size - 1} of the same "
                         f"epoch and seed, got {[(p.rank, p.world_size, p.epoch, p.seed) for p in positions]}")
    rest: list[Piece] = []
    for p in sorted(positions, key=lambda p: p.rank):
        plan = p.plan if p.plan is not None else dealt(num_blocks, p.rank, p.world_size, p.epoch, p.seed)
        for i, (block, first) in enumerate(plan[p.block:]):
            rest.append((block, max(first, p.row) if i == 0 else first))
    return [ShardPosition(old.epoch, 0, 0, old.seed, r, world_size, tuple(rest[r::world_size]))
            for r in range(world_size)]


@dataclass
class WalkStats:
    """What the last walk held and read: blocks read, and the most blocks held at once."""

    blocks_read: int = 0
    max_blocks_held: int = 0


@dataclass
class Shard:
    """Rank `rank` of `world_size`'s part of `dataset`. Every `iter_*` call returns an iterable whose each
    walk is one epoch (the next one, or the rest of a resumed one)."""

    dataset: Dataset
    rank: int = 0
    world_size: int = 1
    seed: int | None = None
    _next: ShardPosition | None = None
    _current: ShardPosition | None = None
    stats: WalkStats = field(default_factory=WalkStats)

    def __post_init__(self) -> None:
        if not (isinstance(self.world_size, int) and self.world_size >= 1 and 0 <= self.rank < self.world_size):
            raise ValueError(f"shard(rank={self.rank}, world_size={self.world_size}): need 0 <= rank < world_size")
        if self._next is None:
            self._next = ShardPosition(0, 0, 0, self.seed, self.rank, self.world_size)

    # -- position -------------------------------------------------------------------

    def position(self) -> ShardPosition:
        """Where the next batch starts (in the walk under way, or the next walk)."""
        assert self._next is not None
        return self._current if self._current is not None else self._next

    def resume(self, position: ShardPosition) -> None:
        """The next walk starts at `position` (this rank's, from `position()` or `split_rest`)."""
        if (position.rank, position.world_size) != (self.rank, self.world_size):
            raise ValueError(f"resume: the position is rank {position.rank} of {position.world_size}, this shard is "
                             f"rank {self.rank} of {self.world_size}; deal it again with split_rest")
        self.seed = position.seed
        self._next, self._current = position, None

    # -- iterators ------------------------------------------------------------------

    def iter_batches(self, *, batch_size: int | None = 256, batch_format: str = "default", drop_last: bool = False,
                     local_shuffle_buffer_size: int | None = None, local_shuffle_seed: int | None = None,
                     **_ignored: Any) -> _Walkable:
        batch_format = check_format(batch_format, "iter_batches")
        return _Walkable(lambda: (to_batch(t, batch_format) for t in self._tables(
            batch_size, drop_last, local_shuffle_buffer_size, local_shuffle_seed)))

    def iter_torch_batches(self, *, batch_size: int | None = 256, dtypes: Any = None, device: Any = "auto",
                           collate_fn: Any = None, drop_last: bool = False,
                           local_shuffle_buffer_size: int | None = None, local_shuffle_seed: int | None = None,
                           **_ignored: Any) -> _Walkable:
        def walk() -> Iterator[Any]:
            target = _device(device)
            for table in self._tables(batch_size, drop_last, local_shuffle_buffer_size, local_shuffle_seed):
                batch = to_batch(table, "numpy")
                yield collate_fn(batch) if collate_fn is not None else _torch(batch, dtypes, target)
        return _Walkable(walk)

    def iter_rows(self) -> _Walkable:
        def walk() -> Iterator[dict[str, Any]]:
            for table in self._tables(1024, False, None, None):
                columns = to_batch(table, "numpy")
                for i in range(table.num_rows):
                    yield {k: v[i] for k, v in columns.items()}
        return _Walkable(walk)

    def count(self) -> int:
        """This shard's rows in an epoch (reads its blocks, one at a time)."""
        plan = dealt(self.dataset.num_blocks(), self.rank, self.world_size, 0, self.seed)
        return sum(self.dataset.read_block(b).num_rows - first for b, first in plan)

    # -- the walk -------------------------------------------------------------------

    def _tables(self, batch_size: int | None, drop_last: bool, shuffle_buffer: int | None,
                shuffle_seed: int | None) -> Iterator[Any]:
        import pyarrow as pa

        assert self._next is not None
        start = self._next
        plan = start.plan if start.plan is not None else dealt(
            self.dataset.num_blocks(), self.rank, self.world_size, start.epoch, start.seed)
        # The walk after this one is the next epoch, dealt as usual; a walk left part-way reports where.
        self._next = ShardPosition(start.epoch + 1, 0, 0, start.seed, self.rank, self.world_size)
        self._current = start
        self.stats = WalkStats()
        pending: deque[tuple[int, int, Any]] = deque()  # (plan index, first row, rows) not yet batched
        try:
            for index in range(start.block, len(plan)):
                block, first = plan[index]
                first = max(first, start.row) if index == start.block else first
                table = self.dataset.read_block(block)
                self.stats.blocks_read += 1
                if shuffle_buffer:
                    seed = (shuffle_seed if shuffle_seed is not None else 0) * 7919 + start.epoch * 104_729 + block
                    order = list(range(table.num_rows))
                    random.Random(seed).shuffle(order)
                    table = table.take(pa.array(order, pa.int64()))
                if first < table.num_rows:
                    pending.append((index, first, table.slice(first)))
                self.stats.max_blocks_held = max(self.stats.max_blocks_held, len(pending))
                size = batch_size or sum(t.num_rows for _, _, t in pending)
                while batch_size and sum(t.num_rows for _, _, t in pending) >= size:
                    yield self._take(pending, size, plan, index + 1, start)
            if pending and not drop_last:
                yield self._take(pending, sum(t.num_rows for _, _, t in pending), plan, len(plan), start)
            self._current = None
        finally:
            if self._current is not None and self._current.epoch == start.epoch:
                self._next = self._current  # left part-way: the next walk goes on from here

    def _take(self, pending: deque[tuple[int, int, Any]], size: int, plan: tuple[Piece, ...], after: int, start: ShardPosition) -> Any:
        import pyarrow as pa

        parts = []
        while size:
            index, first, table = pending.popleft()
            part = table.slice(0, size)
            parts.append(part)
            size -= part.num_rows
            if part.num_rows < table.num_rows:
                pending.appendleft((index, first + part.num_rows, table.slice(part.num_rows)))
        index, row = (pending[0][0], pending[0][1]) if pending else (after, 0)
        self._current = replace(start, block=index, row=row)
        return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


class _Walkable:
    """An iterable that can be walked again: each `for` is a new walk (Ray's iterators behave so)."""

    def __init__(self, walk: Any) -> None:
        self._walk = walk

    def __iter__(self) -> Iterator[Any]:
        return iter(self._walk())


def _device(device: Any) -> Any:
    if device != "auto":
        return device
    try:
        from outlast.train.torch.helpers import get_device

        return get_device()  # type: ignore[no-untyped-call]
    except Exception:  # noqa: BLE001 - outside a training run: the CPU
        return "cpu"


def _torch(batch: dict[str, Any], dtypes: Any, device: Any) -> dict[str, Any]:
    import numpy as np
    import torch

    out = {}
    for name, column in batch.items():
        if getattr(column, "dtype", None) is None or column.dtype.kind not in "biufc":
            out[name] = column  # text and objects: torch has no tensor for them
            continue
        dtype = dtypes.get(name) if isinstance(dtypes, dict) else dtypes
        column = np.require(column, requirements="W")  # Arrow's buffers are read-only; torch wants to own one
        out[name] = torch.as_tensor(column).to(device=device, dtype=dtype) if dtype is not None else \
            torch.as_tensor(column).to(device)
    return out
