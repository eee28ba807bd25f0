"""A dataset as rows by index, read as slices of its blocks: what `get_dataset_shard` reads a Dataset through.

An epoch's rows are its blocks' rows in the epoch's block order (as read, or shuffled per epoch by
randomize_block_order's seed), numbered from 0. outlast.train.data splits those numbers between the
ranks, `len // world_size` each in contiguous ranges (train/data_position.py), so that every rank takes
as many steps and reads only its own blocks (rows dealt in turn, as prepare_data_loader's are, would be
in every block); a rank's batch of row numbers is read here as slices of the one or two blocks it spans.
A view holds only the blocks of the batch it read last: a rank reads its own blocks (and the one or two it
shares with a neighbour), each once per epoch when it reads in order.

Each block's row count is needed before the first batch, to place the ranges. Parquet's footers give it
for a read, and so does a one-file-one-row read (images, binary files), and transforms that keep the
rows (map, add_column, select_columns, drop_columns) keep it; otherwise (csv, json, text, numpy, or
after map_batches, filter, flat_map) every block is read and transformed once, to count its rows.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from outlast.data.batches import to_batch

if TYPE_CHECKING:
    from outlast.data.dataset import Dataset

def block_order(num_blocks: int, epoch: int, seed: int | None) -> list[int]:
    """The order of the blocks in an epoch: as read, or a permutation set by (seed, epoch)."""
    order = list(range(num_blocks))
    if seed is not None:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


ROW_KEEPING_OPS = frozenset({"map", "add_column", "select_columns", "drop_columns"})
ONE_ROW_READS = frozenset({"images", "binary"})


def block_rows_known(dataset: Dataset) -> list[int] | None:
    """Each block's rows after the transforms, when they are known without reading (else None)."""
    if any(op.kind not in ROW_KEEPING_OPS for op in dataset.ops):
        return None
    counts = [t.rows if t.rows is not None else 1 if t.kind in ONE_ROW_READS else None for t in dataset.tasks]
    return None if any(c is None for c in counts) else [int(c) for c in counts if c is not None]


def by_block(rows: Any, starts: Any) -> tuple[list[tuple[int, Any]], Any]:
    """Row numbers `rows` grouped by block: [(position in the block order, that block's rows of `rows`, in their
    order)] in the order the blocks first come, and the order that puts the groups' rows, concatenated, back in
    the order of `rows` (None when they are in it already, as when the rows run in order).
    `starts` is the first row number of each block in the order, and the total last."""
    import numpy as np

    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) == 0:
        return [], None
    if rows.min() < 0 or rows.max() >= starts[-1]:
        raise IndexError(f"rows {int(rows.min())}..{int(rows.max())} are outside the dataset's {int(starts[-1])}")
    at = np.searchsorted(starts, rows, side="right") - 1
    if np.all(np.diff(at) >= 0):  # blocks one after another: each block's rows are one stretch of `rows`
        cuts = np.flatnonzero(np.diff(at)) + 1
        return [(int(at[s]), rows[s:e] - starts[at[s]]) for s, e in zip([0, *cuts], [*cuts, len(rows)])], None
    _, first = np.unique(at, return_index=True)
    blocks = at[np.sort(first)]
    where = [np.flatnonzero(at == b) for b in blocks]
    back = np.empty(len(rows), dtype=np.int64)
    back[np.concatenate(where)] = np.arange(len(rows))
    return [(int(b), rows[w] - starts[b]) for b, w in zip(blocks, where)], back


class BlockRows:
    """`dataset`'s rows by number: `len()`, and `take(rows, epoch)` (a pyarrow Table) or `columns(rows, epoch)`."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self._counts: list[int] | None = block_rows_known(dataset)
        self._held: dict[int, Any] = {}  # block id -> table: the blocks the last take read
        self._starts: tuple[int, Any] | None = None  # (epoch, first row number of each block in its order)
        self.blocks_read = 0

    def counts(self) -> list[int]:
        if self._counts is None:
            self._counts = [self.dataset.read_block(b).num_rows for b in range(self.dataset.num_blocks())]
        return self._counts

    def __len__(self) -> int:
        return sum(self.counts())

    def order(self, epoch: int) -> list[int]:
        return block_order(self.dataset.num_blocks(), epoch, self.dataset.block_seed)

    def take(self, rows: Any, epoch: int = 0) -> Any:
        import numpy as np
        import pyarrow as pa

        if self._starts is None or self._starts[0] != epoch:
            counts = self.counts()
            self._starts = (epoch, np.concatenate([[0], np.cumsum([counts[b] for b in self.order(epoch)])]))
        order, held = self.order(epoch), {}
        parts = []
        groups, back = by_block(rows, self._starts[1])
        for at, local in groups:
            block = order[at]
            table = held.get(block)
            if table is None:
                table = self._held.get(block)
                if table is None:
                    table = self.dataset.read_block(block)
                    self.blocks_read += 1
                held[block] = table
            if len(local) == int(local[-1]) - int(local[0]) + 1 and np.all(np.diff(local) == 1):
                parts.append(table.slice(int(local[0]), len(local)))  # a run: no copy
            else:
                parts.append(table.take(pa.array(local)))
        self._held = held
        if not parts:
            return self.dataset.read_block(0).slice(0, 0) if self.dataset.num_blocks() else pa.table({})
        table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        return table if back is None else table.take(pa.array(back))

    def columns(self, rows: Any, epoch: int = 0) -> dict[str, Any]:
        """`take`'s rows as numpy columns (a batch of Ray Data's "numpy" format)."""
        return to_batch(self.take(rows, epoch), "numpy")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_held": {}, "_starts": None}
