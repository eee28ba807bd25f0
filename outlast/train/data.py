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

With `DataConfig(virtual_ranks=V)` a split dataset is cut into V shares that stay the same at every world
size, and each rank reads the shares of the virtual ranks it holds, a batch of each a step: a step's rows
do not depend on how many ranks read them, which is what a run needs to end with the same weights through
a resize (`outlast.train.torch.virtual_rank_gradients` reduces their gradients in one order at any world).
"""

from __future__ import annotations

import dataclasses
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
    """Which datasets to split between the ranks ("all", or a list of names); the others go whole to each rank.

    `virtual_ranks` (outlast's own; Ray has none): split each of them into that many shares, fixed for the
    run, whatever its world size; a rank reads the shares of the virtual ranks it holds (a contiguous run
    of them), one batch of each per step, and its iterators hand it `VirtualBatches`. At least the run's
    largest world size; a multiple of each world size it runs at gives every rank as many."""

    datasets_to_split: Literal["all"] | list[str] = "all"
    execution_options: Any = None
    enable_shard_locality: bool = True
    virtual_ranks: int | None = None

    def __post_init__(self) -> None:
        if self.datasets_to_split != "all" and not (
                isinstance(self.datasets_to_split, (list, tuple))
                and all(isinstance(n, str) for n in self.datasets_to_split)):
            raise ValueError(f"DataConfig.datasets_to_split must be 'all' or a list of dataset names, "
                             f"got {self.datasets_to_split!r}")
        if self.execution_options is not None:
            raise ValueError(f"DataConfig(execution_options=...) is not supported: {_UNSUPPORTED}")
        if self.virtual_ranks is not None and (not isinstance(self.virtual_ranks, int)
                                               or isinstance(self.virtual_ranks, bool) or self.virtual_ranks < 1):
            raise ValueError(f"DataConfig.virtual_ranks must be a positive int (or None), got {self.virtual_ranks!r}")

    def check_world(self, max_workers: int) -> None:
        """Refuse a run that can have more ranks than virtual ranks: a rank would hold none and read nothing."""
        if self.virtual_ranks is not None and max_workers > self.virtual_ranks:
            raise ValueError(f"DataConfig(virtual_ranks={self.virtual_ranks}) cannot be read by up to {max_workers} "
                             f"workers: each rank needs a virtual rank of its own; set virtual_ranks to at least "
                             f"{max_workers} (a multiple of every world size the run has gives each rank as many)")

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
    seed_base: int | None = None  # the run's shared seed (`data_position.run_seed`) under live recovery
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
        first = saved[min(saved)]
        why = self._epochs.resume_from(saved, self._new_seed(first.epoch, first.generation + 1))
        if why is not None:
            log.warning("dataset %r: epoch %d is read again from its start: %s", self.name,
                        self._epochs.next_epoch, why)

    def regroup(self, saved: dict[int, dp.Position], rank: int, world: int) -> None:
        """A live grow made this rank `rank` of `world`: the rest of the epoch is split again from the old world's
        positions (`saved`), and a walk under way goes on with this rank's new share at its next batch."""
        first = saved[min(saved)]
        self.rank, self.world = rank, world
        self._epochs.regroup(saved, rank, world, self._new_seed(first.epoch, first.generation + 1, rank))

    def _new_seed(self, epoch: int, generation: int, rank: int | None = None) -> int:
        """A seed for this rank's shuffle of its share in a generation of an epoch, where the loop gave none: from
        the run's shared seed under live recovery, so that a replacement can tell it (`positions.take_up`), else
        at random."""
        if self.seed_base is not None:
            return dp.rank_seed(self.seed_base, epoch, generation, self._epochs.rank if rank is None else rank)
        return random.getrandbits(62)

    def _walk_batches(self, batch_size: int | None, drop_last: bool, shuffle_buffer: int | None,
                      seed: int | None, convert: Callable[[Any], Any]) -> Iterator[Any]:
        positions.restore()
        epoch = self._epochs.next_epoch
        # Rows shuffled within this rank's shard, differently each epoch (seeded: reproducibly).
        p, why = self._epochs.begin(bool(shuffle_buffer), seed + epoch if seed is not None else self._new_seed(epoch, 0))
        if why is not None:
            log.warning("dataset %r: %s: it starts over", self.name, why)
        window = shuffle_buffer if self.source.streamed else None
        try:
            plan = self._epochs.walk
            while plan is not None:
                left, least = dp.rows_left(plan, window)
                for start, end in dp.batch_bounds(len(left), least, batch_size or max(len(left), 1), drop_last):
                    chunk = left[start:end]
                    # Counted before the loop sees the batch: a checkpoint reported in the loop body has used it.
                    self._epochs.took(len(chunk))
                    handed = self._epochs.walk
                    yield convert(self.source.take(chunk, p.epoch))
                    if self._epochs.walk is not handed:
                        break  # regrouped while the loop held the batch (a live grow)
                else:
                    break  # read to its end
                plan = self._epochs.walk  # the new share, from its start
        finally:
            self._epochs.end(p)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"get_dataset_shard({self.name!r}).{name} is not supported: outlast's shards offer "
                             "iter_batches, iter_torch_batches, iter_rows and count; for more, build a torch "
                             "DataLoader in the train function and call prepare_data_loader on it")


def held_virtual_ranks(rank: int, world: int, virtual: int) -> range:
    """The virtual ranks rank `rank` of `world` holds: a contiguous run, the first ranks' one shorter when
    `virtual` does not divide by `world` (so that with 3 of 2 ranks, rank 1 holds two)."""
    return range(rank * virtual // world, (rank + 1) * virtual // world)


class VirtualBatches(list):  # type: ignore[type-arg]
    """One step's batches of a rank that holds virtual ranks: a batch of each, in the order of `virtual_ranks`."""

    def __init__(self, batches: list[Any], virtual_ranks: tuple[int, ...], virtual_world: int) -> None:
        super().__init__(batches)
        self.virtual_ranks, self.virtual_world = virtual_ranks, virtual_world


class _VirtualPart(DataShard):
    """The share of one virtual rank: a shard of a world that never changes size (`world` is the virtual one)."""

    def resume_from(self, saved: dict[int, dp.Position]) -> None:
        """Go on from this virtual rank's own saved position: the rank that held it saved it, in the same virtual
        world, so the share is the same and nothing is split again (every virtual rank steps in lockstep, so
        the others' places are this one's, with their own seeds)."""
        mine = [p for p in saved.values() if p.world == self.world and p.rank == self.rank]
        if len(mine) != 1:
            found = sorted((p.rank, p.world) for p in saved.values())
            log.warning("dataset %r: virtual rank %d of %d has no saved position of its own (found rank, world "
                        "%s): epoch %d is read again from its start", self.name, self.rank, self.world, found,
                        self._epochs.next_epoch)
            return
        super().resume_from({r: dataclasses.replace(mine[0], rank=r) for r in range(self.world)})


class VirtualRankShard:
    """A rank's part of a dataset split between virtual ranks (`DataConfig(virtual_ranks=...)`): the shares of
    the virtual ranks it holds, walked together; each step hands the loop `VirtualBatches`, a batch of each."""

    def __init__(self, name: str, source: _Source, rank: int, world: int, virtual_world: int) -> None:
        if world > virtual_world:
            raise ValueError(f"dataset {name!r}: {world} ranks cannot share {virtual_world} virtual ranks; set "
                             f"DataConfig(virtual_ranks=...) to at least {world}")
        self.name, self.virtual_world = name, virtual_world
        self.virtual_ranks = tuple(held_virtual_ranks(rank, world, virtual_world))
        self.parts = [_VirtualPart(name, source, v, virtual_world, True) for v in self.virtual_ranks]

    def count(self) -> int:
        return sum(p.count() for p in self.parts)

    def __len__(self) -> int:
        return self.count()

    def iter_batches(self, **kwargs: Any) -> Iterable[VirtualBatches]:
        """iter_batches of each virtual rank's share, in step: see DataShard.iter_batches for the arguments."""
        return _Together(self, [p.iter_batches(**kwargs) for p in self.parts])

    def iter_torch_batches(self, **kwargs: Any) -> Iterable[VirtualBatches]:
        """iter_torch_batches of each virtual rank's share, in step: see DataShard.iter_torch_batches."""
        return _Together(self, [p.iter_torch_batches(**kwargs) for p in self.parts])

    def iter_rows(self) -> Iterable[VirtualBatches]:
        """A row of each virtual rank's share a step."""
        return _Together(self, [p.iter_rows() for p in self.parts])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"get_dataset_shard({self.name!r}).{name} is not supported with virtual ranks: their "
                             "shards offer iter_batches, iter_torch_batches, iter_rows and count")


class _Together:
    """The walks of a rank's virtual ranks, one batch of each per step. Every virtual rank has as many batches
    (`data_position.batch_bounds` counts them from the rank with the fewest rows left), so all end together. Each
    walk is asked for its next batch every step, the last one too, so that every walk begins its epoch (a walk
    begins at its first `next`: one of an empty rest, after a restore at an epoch's end, must still begin and
    end it) and each is closed when the step loop ends, so that each counts its epoch ended."""

    def __init__(self, shard: VirtualRankShard, walks: list[Iterable[Any]]) -> None:
        self._shard, self._walks = shard, walks

    def __iter__(self) -> Iterator[VirtualBatches]:
        walks = [iter(w) for w in self._walks]
        try:
            while True:
                batches, ended = [], 0
                for walk in walks:
                    try:
                        batches.append(next(walk))
                    except StopIteration:
                        ended += 1
                if ended:
                    if batches:
                        raise RuntimeError(f"dataset {self._shard.name!r}: the walks of virtual ranks "
                                           f"{list(self._shard.virtual_ranks)} ended at different steps")
                    return
                yield VirtualBatches(batches, self._shard.virtual_ranks, self._shard.virtual_world)
        finally:
            for walk in walks:
                close = getattr(walk, "close", None)
                if close is not None:
                    close()


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

_shards: dict[str, DataShard | VirtualRankShard] | None = None


def install_shards(datasets: dict[str, Any], config: DataConfig, rank: int, world_size: int,
                   seed_base: int | None = None) -> None:
    """Each dataset's shard for rank `rank` of `world_size`. `seed_base`: the run's shared seed, from which a rank
    that shuffles without the loop's seed draws (live recovery's, so that a replacement can tell the lost rank's
    seed); None: at random."""
    global _shards
    _shards = {}
    for name, data in datasets.items():
        source = to_source(name, data)
        if config.virtual_ranks is not None and config.splits(name):
            if seed_base is not None:
                raise ValueError(f"dataset {name!r}: DataConfig(virtual_ranks=...) is not for live recovery, whose "
                                 "LiveTraining reduces the gradients itself: drop one or the other")
            shard = VirtualRankShard(name, source, rank, world_size, config.virtual_ranks)
            _shards[name] = shard
            for part in shard.parts:  # each under its virtual rank's key, which whoever holds it next reads
                positions.track(f"dataset:{name}@{part.rank}", part)
        else:
            _shards[name] = DataShard(name, source, rank, world_size, config.splits(name), seed_base)
            positions.track(f"dataset:{name}", _shards[name])


def get_dataset_shard(dataset_name: str | None = None) -> DataShard | VirtualRankShard:
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
