"""`get_dataset_shard()`: the datasets a PyTorch user has, cut into one shard per rank.

Ray Train hands each rank a Ray Data iterator; outlast takes the data itself, in memory:
a torch `Dataset`, a Hugging Face `datasets.Dataset`, a numpy array or torch tensor, a dict
of equally long columns, a pandas DataFrame, or a list of rows; or an `outlast.data` Dataset
(Ray Data's reads, `ray.data` under `outlast run`), which each rank reads a block at a time,
only the blocks its rows are in. The trainer ships them to every worker with the train
function; each rank reads its shard with the iterator methods Ray's examples use
(`iter_torch_batches`, `iter_batches`, `iter_rows`).

A split dataset gives each rank the same number of rows, `len // world_size`, in contiguous
blocks (the remainder is left out, so that every rank takes as many steps).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from outlast.train import data_position as dp
from outlast.train import positions

log = logging.getLogger("outlast.worker")

TRAIN_DATASET_KEY = "train"

_UNSUPPORTED = ("outlast reads datasets in memory: pass a torch Dataset, a Hugging Face datasets.Dataset, a numpy "
                "array, a dict of columns, a pandas DataFrame or a list of rows, or build a torch DataLoader in the "
                "train function and call outlast.train.torch.prepare_data_loader on it")


@dataclass
class DataConfig:
    """Which datasets to split between the ranks ("all", or a list of names); the others go whole to each rank."""

    datasets_to_split: Literal["all"] | list[str] = "all"
    execution_options: Any = None
    enable_shard_locality: bool = True

    def __post_init__(self) -> None:
        if self.datasets_to_split != "all" and not (
                isinstance(self.datasets_to_split, (list, tuple))
                and all(isinstance(n, str) for n in self.datasets_to_split)):
            raise ValueError(f"DataConfig.datasets_to_split must be 'all' or a list of dataset names, "
                             f"got {self.datasets_to_split!r}")
        if self.execution_options is not None:
            raise ValueError(f"DataConfig(execution_options=...) is not supported: {_UNSUPPORTED}")

    def splits(self, name: str) -> bool:
        return self.datasets_to_split == "all" or name in self.datasets_to_split


@dataclass
class _Source:
    """A dataset as rows that can be taken by index: columns (name -> sequence) or items."""

    length: int
    columns: dict[str, Any] | None = None
    items: Any = None  # a torch Dataset: dataset[i] is a row
    hf: Any = None  # a Hugging Face Dataset: dataset[list of i] is a dict of columns
    # An outlast.data Dataset's rows (outlast.data.block_rows.BlockRows): blocks.take(rows, epoch) is a pyarrow
    # Table of those rows, numbered in the epoch's block order and read as slices of the blocks.
    blocks: Any = None

    @property
    def streamed(self) -> bool:
        """Read a block at a time: a shuffle keeps to a window of rows (the loop's local_shuffle_buffer_size)."""
        return self.blocks is not None

    def take(self, rows: Any, epoch: int = 0) -> Any:
        import numpy as np

        if self.blocks is not None:
            return self.blocks.columns(rows, epoch)
        indices = rows.tolist() if hasattr(rows, "tolist") else list(rows)
        if self.columns is not None:
            return {k: _index(v, indices) for k, v in self.columns.items()}
        if self.hf is not None:
            batch = self.hf[indices]
            return {k: np.asarray(v) for k, v in batch.items()}
        return [self.items[i] for i in indices]


def _index(column: Any, indices: list[int]) -> Any:
    import numpy as np

    if hasattr(column, "shape"):  # numpy array or torch tensor
        return column[indices] if isinstance(column, np.ndarray) else column[indices].numpy()
    return np.asarray([column[i] for i in indices])


def to_source(name: str, data: Any) -> _Source:
    """Check a dataset handed to a trainer and say how to read it; refuse what outlast cannot."""
    import numpy as np

    if getattr(type(data), "__outlast_dataset__", False):  # outlast.data (ray.data under `outlast run`)
        rows = data.rows()
        return _Source(len(rows), blocks=rows)
    kind = f"{type(data).__module__}.{type(data).__qualname__}"
    if kind.startswith("ray.data"):
        raise TypeError(f"datasets[{name!r}] is a Ray Data dataset ({kind}), which outlast does not run: {_UNSUPPORTED}")
    if hasattr(data, "column_names") and hasattr(data, "with_format"):  # Hugging Face datasets.Dataset
        return _Source(len(data), hf=data.with_format("numpy"))
    if kind.startswith("pandas.") and hasattr(data, "to_dict") and hasattr(data, "columns"):
        return _columns(name, {str(c): data[c].to_numpy() for c in data.columns})
    if isinstance(data, dict):
        return _columns(name, data)
    if isinstance(data, np.ndarray) or kind.startswith("torch.") and hasattr(data, "shape"):
        return _columns(name, {"data": data})
    if isinstance(data, list):
        if data and all(isinstance(row, dict) for row in data):
            keys = list(data[0])
            if any(list(row) != keys for row in data):
                raise ValueError(f"datasets[{name!r}]: every row must have the same keys as the first, {keys}")
            return _columns(name, {k: [row[k] for row in data] for k in keys})
        return _columns(name, {"item": data})
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):  # a torch Dataset, or any map-style one
        return _Source(len(data), items=data)
    raise TypeError(f"datasets[{name!r}] is a {kind}: {_UNSUPPORTED}")


def _columns(name: str, columns: dict[str, Any]) -> _Source:
    lengths = {k: len(v) for k, v in columns.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"datasets[{name!r}]: columns of different lengths {lengths}")
    return _Source(next(iter(lengths.values()), 0), columns=dict(columns))


def shard_indices(length: int, rank: int, world_size: int, split: bool) -> range:
    """Rank `rank`'s rows: a contiguous block of `length // world_size` rows, or all rows unsplit."""
    if not split:
        return range(length)
    per = length // world_size
    return range(rank * per, (rank + 1) * per)


@dataclass
class DataShard:
    """One rank's part of a dataset, read in batches as often as the loop likes (once per epoch).

    Each walk over an iterator it returns is one epoch. The shard keeps its place in the epoch
    (`data_position`), which every checkpoint saves; a restored run's first walk goes on at the next
    batch of the epoch it was in, with the rest of the epoch split again when the world size changed."""

    name: str
    source: _Source
    rank: int = 0
    world: int = 1
    split: bool = True
    _epochs: dp.Epochs = field(init=False)

    def __post_init__(self) -> None:
        # Contiguous shares (not a DistributedSampler's strided ones): a rank of an outlast.data Dataset reads
        # only the blocks its rows are in, each once an epoch; rows dealt in turn would be in every block.
        self._epochs = dp.Epochs(self.source.length, self.rank, self.world, self.split, strided=False)

    @property
    def indices(self) -> range:
        return shard_indices(self.source.length, self.rank, self.world, self.split)

    def __len__(self) -> int:
        return len(self.indices)

    def count(self) -> int:
        return len(self.indices)

    def materialize(self) -> "DataShard":
        """The shard itself: it is in memory already (what Ray Data's materialize() makes it)."""
        return self

    def to_pandas(self) -> Any:
        """The whole shard as one pandas DataFrame (read apart from the epochs: it moves no position)."""
        import pandas as pd

        rows = list(self.indices)
        if not rows:
            return pd.DataFrame()
        return _to_pandas(_to_numpy(self.source.take(rows)))

    def iter_batches(self, *, batch_size: int | None = 256, batch_format: str = "default", drop_last: bool = False,
                     local_shuffle_buffer_size: int | None = None, local_shuffle_seed: int | None = None,
                     prefetch_batches: int = 1, **_: Any) -> Iterable[Any]:
        """Batches as dicts of numpy arrays ("default"/"numpy") or pandas DataFrames ("pandas"), as an
        iterable that each walk reads again (one epoch a walk), as Ray's is."""
        if batch_format not in ("default", "numpy", "pandas"):
            raise ValueError(f"iter_batches(batch_format={batch_format!r}): outlast gives 'numpy' (the default) "
                             "or 'pandas'")

        def convert(batch: Any) -> Any:
            batch = _to_numpy(batch)
            return _to_pandas(batch) if batch_format == "pandas" else batch

        return BatchIterable(self, batch_size, drop_last, local_shuffle_buffer_size, local_shuffle_seed, convert)

    def iter_torch_batches(self, *, batch_size: int | None = 256, dtypes: Any = None, device: Any = "auto",
                           collate_fn: Any = None, drop_last: bool = False,
                           local_shuffle_buffer_size: int | None = None, local_shuffle_seed: int | None = None,
                           prefetch_batches: int = 1, **_: Any) -> Iterable[Any]:
        """Batches as dicts of tensors on this worker's device (rows of a torch Dataset collated as a
        DataLoader would); `collate_fn` receives the numpy batch instead. Each walk is one epoch."""
        if device == "auto":
            from outlast.train.torch.helpers import get_device

            device = get_device()

        def convert(batch: Any) -> Any:
            import numpy as np
            import torch
            from torch.utils.data import default_collate

            if collate_fn is not None:
                return collate_fn(_to_numpy(batch))
            # Columns of text or objects stay numpy arrays: torch has no tensor for them.
            # Arrow's buffers (an outlast.data Dataset's columns) are read-only: torch gets a copy it may write.
            batch = default_collate(batch) if isinstance(batch, list) else \
                {k: torch.as_tensor(np.require(v, requirements="W"))
                 if getattr(v, "dtype", None) is not None and v.dtype.kind in "biufc" else v
                 for k, v in batch.items()}
            return _to_torch(batch, dtypes, device)

        return BatchIterable(self, batch_size, drop_last, local_shuffle_buffer_size, local_shuffle_seed, convert)

    def iter_rows(self) -> Iterable[Any]:
        """The shard's rows one by one; each walk is one epoch."""
        def row(batch: Any) -> Any:
            return batch[0] if isinstance(batch, list) else {k: v[0] for k, v in batch.items()}

        return BatchIterable(self, 1, False, None, None, row)

    # -- the position ------------------------------------------------------------

    def data_position(self) -> dp.Position:
        """Where the shard is: the epoch being read, or the start of the next one."""
        return self._epochs.position()

    def resume_from(self, saved: dict[int, dp.Position]) -> None:
        """Go on from the positions every rank saved (rank -> position): the next walk reads the rest of
        the saved epoch, or the next epoch when the saved one had ended."""
        why = self._epochs.resume_from(saved, random.getrandbits(62))
        if why is not None:
            log.warning("dataset %r: epoch %d is read again from its start: %s", self.name,
                        self._epochs.next_epoch, why)

    def _walk_batches(self, batch_size: int | None, drop_last: bool, shuffle_buffer: int | None,
                      seed: int | None, convert: Callable[[Any], Any]) -> Iterator[Any]:
        positions.restore()
        epoch = self._epochs.next_epoch
        # Rows shuffled within this rank's shard, differently each epoch (seeded: reproducibly).
        p, why = self._epochs.begin(bool(shuffle_buffer), seed + epoch if seed is not None else random.getrandbits(62))
        if why is not None:
            log.warning("dataset %r: %s: it starts over", self.name, why)
        try:
            left, least = dp.rows_left(p, shuffle_buffer if self.source.streamed else None)
            for start, end in dp.batch_bounds(len(left), least, batch_size or max(len(left), 1), drop_last):
                chunk = left[start:end]
                # Counted before the loop sees the batch: a checkpoint reported in the loop body has used it.
                self._epochs.took(len(chunk))
                yield convert(self.source.take(chunk, p.epoch))
        finally:
            self._epochs.end(p)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"get_dataset_shard({self.name!r}).{name} is not supported: outlast's shards offer "
                             "iter_batches, iter_torch_batches, iter_rows and count; for more, build a torch "
                             "DataLoader in the train function and call prepare_data_loader on it")


class BatchIterable:
    """What an iterator method returns: an iterable each walk over which reads one epoch of the shard."""

    def __init__(self, shard: DataShard, batch_size: int | None, drop_last: bool, shuffle_buffer: int | None,
                 seed: int | None, convert: Callable[[Any], Any]) -> None:
        self._args = (batch_size, drop_last, shuffle_buffer, seed)
        self._shard = shard
        self._convert = convert

    def __iter__(self) -> Iterator[Any]:
        return self._shard._walk_batches(*self._args, self._convert)


def _to_pandas(batch: dict[str, Any]) -> Any:
    import pandas as pd

    return pd.DataFrame({k: list(v) if getattr(v, "ndim", 1) > 1 else v for k, v in batch.items()})


def _to_numpy(batch: Any) -> Any:
    import numpy as np

    if isinstance(batch, dict):
        return batch
    from torch.utils.data import default_collate

    collated = default_collate(batch)
    if isinstance(collated, dict):
        return {k: np.asarray(v) for k, v in collated.items()}
    if isinstance(collated, (list, tuple)):
        return {str(i): np.asarray(v) for i, v in enumerate(collated)}
    return {"data": np.asarray(collated)}


def _to_torch(batch: Any, dtypes: Any, device: Any) -> Any:
    if isinstance(batch, dict):
        return {k: _to_torch(v, dtypes.get(k) if isinstance(dtypes, dict) else dtypes, device)
                for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_torch(v, dtypes, device) for v in batch)
    if hasattr(batch, "to"):
        return batch.to(device=device, dtype=dtypes) if dtypes is not None else batch.to(device)
    return batch


# -- the worker's side ------------------------------------------------------------

_shards: dict[str, DataShard] | None = None


def install_shards(datasets: dict[str, Any], config: DataConfig, rank: int, world_size: int) -> None:
    global _shards
    _shards = {}
    for name, data in datasets.items():
        source = to_source(name, data)
        _shards[name] = DataShard(name, source, rank, world_size, config.splits(name))
        positions.track(f"dataset:{name}", _shards[name])


def get_dataset_shard(dataset_name: str | None = None) -> DataShard:
    """This rank's shard of the dataset passed to the trainer as `datasets={dataset_name: ...}`."""
    from outlast.train._session import get_session

    get_session("get_dataset_shard")
    if not _shards:
        raise KeyError("get_dataset_shard(): the trainer was given no datasets; pass them as "
                       "TorchTrainer(..., datasets={'train': your_dataset})")
    if dataset_name is None:
        if len(_shards) != 1:
            raise KeyError(f"get_dataset_shard() needs a name: the trainer has datasets {sorted(_shards)}")
        return next(iter(_shards.values()))
    if dataset_name not in _shards:
        raise KeyError(f"get_dataset_shard({dataset_name!r}): the trainer has datasets {sorted(_shards)}")
    return _shards[dataset_name]
