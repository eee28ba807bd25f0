"""The whole dataset walked a block at a time and cut into batches: Dataset.iter_batches, iter_torch_batches
and iter_rows (a rank's part of it is `Dataset.shard`, what `get_dataset_shard` gives).

Each call returns an iterable that can be walked again, each walk the next epoch (blocks in the epoch's
order, shuffled per epoch by randomize_block_order's seed), as Ray's iterables are. A walk holds the block
being read and the rows of the one before that did not fill a batch.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from outlast.data.batches import check_format, to_batch
from outlast.data.block_rows import block_order

if TYPE_CHECKING:
    from outlast.data.dataset import Dataset


def tables(dataset: Dataset, epoch: int, batch_size: int | None, drop_last: bool, shuffle_buffer: int | None,
           shuffle_seed: int | None) -> Iterator[Any]:
    """One epoch's batches as pyarrow Tables; `shuffle_buffer` shuffles each block's rows (seeded per epoch)."""
    import pyarrow as pa

    pending: deque[Any] = deque()
    held = 0
    for block in block_order(dataset.num_blocks(), epoch, dataset.block_seed):
        table = dataset.read_block(block)
        if shuffle_buffer:
            order = list(range(table.num_rows))
            random.Random((shuffle_seed or 0) * 7919 + epoch * 104_729 + block).shuffle(order)
            table = table.take(pa.array(order, pa.int64()))
        if table.num_rows:
            pending.append(table)
            held += table.num_rows
        while batch_size and held >= batch_size:
            parts, size = [], batch_size
            while size:
                part = pending[0].slice(0, size)
                parts.append(part)
                size -= part.num_rows
                if part.num_rows < pending[0].num_rows:
                    pending[0] = pending[0].slice(part.num_rows)
                else:
                    pending.popleft()
            held -= batch_size
            yield pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    if pending and not drop_last:
        yield pa.concat_tables(list(pending)) if len(pending) > 1 else pending[0]


class Walkable:
    """An iterable that can be walked again: each `for` is the next epoch (Ray's iterables behave so)."""

    def __init__(self, walk: Callable[[int], Iterator[Any]]) -> None:
        self._walk, self._epoch = walk, 0

    def __iter__(self) -> Iterator[Any]:
        epoch, self._epoch = self._epoch, self._epoch + 1
        return iter(self._walk(epoch))


def iter_batches(dataset: Dataset, *, batch_size: int | None = 256, batch_format: str = "default",
                 drop_last: bool = False, local_shuffle_buffer_size: int | None = None,
                 local_shuffle_seed: int | None = None, **_ignored: Any) -> Walkable:
    batch_format = check_format(batch_format, "iter_batches")
    return Walkable(lambda epoch: (to_batch(t, batch_format) for t in tables(
        dataset, epoch, batch_size, drop_last, local_shuffle_buffer_size, local_shuffle_seed)))


def iter_torch_batches(dataset: Dataset, *, batch_size: int | None = 256, dtypes: Any = None, device: Any = "auto",
                       collate_fn: Any = None, drop_last: bool = False, local_shuffle_buffer_size: int | None = None,
                       local_shuffle_seed: int | None = None, **_ignored: Any) -> Walkable:
    def walk(epoch: int) -> Iterator[Any]:
        target = _device(device)
        for table in tables(dataset, epoch, batch_size, drop_last, local_shuffle_buffer_size, local_shuffle_seed):
            batch = to_batch(table, "numpy")
            yield collate_fn(batch) if collate_fn is not None else _torch(batch, dtypes, target)
    return Walkable(walk)


def iter_rows(dataset: Dataset) -> Walkable:
    def walk(epoch: int) -> Iterator[dict[str, Any]]:
        for table in tables(dataset, epoch, 1024, False, None, None):
            columns = to_batch(table, "numpy")
            for i in range(table.num_rows):
                yield {k: v[i] for k, v in columns.items()}
    return Walkable(walk)


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
