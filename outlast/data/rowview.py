"""A dataset as rows by index, for outlast.train.data's in-memory shards (`DataShard`).

`DataShard` reads its rows in order, so a view that keeps the block it last read reads each block
of a rank's range once. Its length needs every block's row count: parquet's footers give it, other
formats are read once, a block at a time, to count.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

from outlast.data.batches import to_batch

if TYPE_CHECKING:
    from outlast.data.dataset import Dataset


class RowView:
    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self._starts: list[int] | None = None
        self._cached: tuple[int, dict[str, Any]] | None = None

    def _offsets(self) -> list[int]:
        if self._starts is None:
            starts, total = [], 0
            for block, task in enumerate(self.dataset.tasks):
                starts.append(total)
                total += task.rows if task.rows is not None and not self.dataset.ops else \
                    self.dataset.read_block(block).num_rows
            self._starts = [*starts, total]
        return self._starts

    def __len__(self) -> int:
        return self._offsets()[-1]

    def __getitem__(self, index: int) -> dict[str, Any]:
        starts = self._offsets()
        if not 0 <= index < starts[-1]:
            raise IndexError(index)
        block = bisect.bisect_right(starts, index) - 1
        if self._cached is None or self._cached[0] != block:
            self._cached = (block, to_batch(self.dataset.read_block(block), "numpy"))
        columns = self._cached[1]
        return {k: v[index - starts[block]] for k, v in columns.items()}

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "_starts": self._starts, "_cached": None}
