"""A lazy dataset: blocks to read and the transforms to run on each, executed a block at a time.

Nothing is read when a dataset is built or transformed. Transforms that Ray runs row by row or batch
by batch (map, map_batches, filter, flat_map, columns) run on each block as a shard reads it; the ones
that need every row at once (random_shuffle, repartition, train_test_split, limit) read the dataset
into memory, as `materialize()` does, and say so in their docstrings.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from outlast.data.batches import check_format, to_batch
from outlast.data.errors import DataReadError
from outlast.data.ops import Op, batch_op
from outlast.data.readers import ReadTask, memory_tasks
from outlast.data import walk
from outlast.data.walk import Walkable

_ADVICE = ("outlast's Dataset offers the reads, map, map_batches, filter, flat_map, add_column, drop_columns, "
           "select_columns, random_shuffle, randomize_block_order, repartition, train_test_split, limit, "
           "materialize, count, schema, take, take_all, to_pandas, iter_batches, iter_torch_batches, iter_rows "
           "and shard; see docs/ray-data-parity.md")


@dataclass(frozen=True)
class Dataset:
    tasks: tuple[ReadTask, ...]
    ops: tuple[Op, ...] = ()
    block_seed: int | None = None  # randomize_block_order(seed): the order of blocks each epoch

    __outlast_dataset__ = True  # outlast.train.data reads it through `rows()` (it may not import this package)

    # -- reading ------------------------------------------------------------------------

    def num_blocks(self) -> int:
        return len(self.tasks)

    def read_block(self, block: int) -> Any:
        """Block `block`, read and transformed; its columns must match the first block's."""
        task = self.tasks[block]
        table = task.read()
        for op in self.ops:
            table = op.apply(table, task.label)
        if not self.ops and task.kind not in ("memory", "parquet"):  # parquet's footers were compared when listed
            # Compared with the first block this process read, so that a rank reads no block but its own.
            seen = self.__dict__.setdefault("_first_seen", {})
            label, expected = seen.setdefault("first", (task.label, table.schema))
            if not table.schema.equals(expected):
                raise DataReadError(f"{task.label} has columns {_names(table.schema)} but {label} has "
                                    f"{_names(expected)}; read files with the same columns and types")
        return table

    def iter_blocks(self) -> Iterator[Any]:
        for block in range(len(self.tasks)):
            yield self.read_block(block)

    # -- transforms (lazy) ----------------------------------------------------------------

    def _with(self, op: Op) -> Dataset:
        return replace(self, ops=(*self.ops, op))

    def map(self, fn: Any, *, fn_args: tuple[Any, ...] = (), fn_kwargs: dict[str, Any] | None = None,
            fn_constructor_args: tuple[Any, ...] = (), fn_constructor_kwargs: dict[str, Any] | None = None, **_ignored: Any) -> Dataset:
        return self._with(Op("map", fn, fn_args=tuple(fn_args), fn_kwargs=dict(fn_kwargs or {}),
                             ctor_args=tuple(fn_constructor_args), ctor_kwargs=dict(fn_constructor_kwargs or {})))

    def map_batches(self, fn: Any, *, batch_size: Any = None, batch_format: str | None = "default",
                    fn_args: tuple[Any, ...] = (), fn_kwargs: dict[str, Any] | None = None, fn_constructor_args: tuple[Any, ...] = (),
                    fn_constructor_kwargs: dict[str, Any] | None = None, zero_copy_batch: bool = False,
                    **_ignored: Any) -> Dataset:
        return self._with(batch_op(fn, batch_format, batch_size, fn_args, fn_kwargs, fn_constructor_args,
                                   fn_constructor_kwargs))

    def filter(self, fn: Any = None, *, expr: Any = None, **_ignored: Any) -> Dataset:
        if fn is None:
            raise ValueError("filter(expr=...) is not supported: pass a function of a row that returns True to keep it")
        return self._with(Op("filter", fn))

    def flat_map(self, fn: Any, *, fn_args: tuple[Any, ...] = (), fn_kwargs: dict[str, Any] | None = None, **_ignored: Any) -> Dataset:
        return self._with(Op("flat_map", fn, fn_args=tuple(fn_args), fn_kwargs=dict(fn_kwargs or {})))

    def add_column(self, col: str, fn: Any, *, batch_format: str | None = "pandas", **_ignored: Any) -> Dataset:
        return self._with(Op("add_column", fn, batch_format=check_format(batch_format, "add_column"), columns=(col,)))

    def drop_columns(self, cols: list[str], **_ignored: Any) -> Dataset:
        return self._with(Op("drop_columns", columns=tuple(cols)))

    def select_columns(self, cols: list[str] | str, **_ignored: Any) -> Dataset:
        return self._with(Op("select_columns", columns=(cols,) if isinstance(cols, str) else tuple(cols)))

    def randomize_block_order(self, *, seed: int | None = None) -> Dataset:
        """Blocks are read in an order shuffled per epoch (by `seed` and the epoch)."""
        import random

        return replace(self, block_seed=seed if seed is not None else random.randrange(2**31))

    # -- transforms that read every row (into memory) -------------------------------------

    def materialize(self) -> Dataset:
        """The dataset read and transformed, kept in memory block by block."""
        import pyarrow as pa

        return Dataset(tuple(ReadTask("memory", table=t, rows=t.num_rows) for t in self.iter_blocks()
                             if isinstance(t, pa.Table)))

    def _table(self) -> Any:
        import pyarrow as pa

        tables = [t for t in self.iter_blocks() if t.num_columns]
        return pa.concat_tables(tables) if tables else pa.table({})

    def random_shuffle(self, *, seed: int | None = None, **_ignored: Any) -> Dataset:
        """Every row shuffled (reads the whole dataset into memory, as Ray's all-to-all shuffle does)."""
        import numpy as np
        import pyarrow as pa

        table = self._table()
        order = np.random.default_rng(seed).permutation(table.num_rows)
        return Dataset(tuple(memory_tasks(table.take(pa.array(order)), _block_rows(table, len(self.tasks)))))

    def repartition(self, num_blocks: int, *, shuffle: bool = False, **_ignored: Any) -> Dataset:
        """The rows in `num_blocks` blocks of nearly equal size (read into memory)."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"repartition({num_blocks!r}): give a positive number of blocks")
        table = self.random_shuffle()._table() if shuffle else self._table()
        return Dataset(tuple(memory_tasks(table, max(1, -(-table.num_rows // num_blocks)))))

    def train_test_split(self, test_size: float | int, *, shuffle: bool = False, seed: int | None = None,
                         **_ignored: Any) -> tuple[Dataset, Dataset]:
        """(train, test): the last `test_size` rows (a count, or a fraction) are the test set."""
        table = (self.random_shuffle(seed=seed) if shuffle else self)._table()
        n = table.num_rows
        if isinstance(test_size, float):
            if not 0 < test_size < 1:
                raise ValueError(f"train_test_split(test_size={test_size}): a fraction must be in (0, 1)")
            test = int(n * test_size)
        else:
            if not 0 < test_size < n:
                raise ValueError(f"train_test_split(test_size={test_size}): the dataset has {n} rows")
            test = test_size
        blocks = len(self.tasks)
        train_t, test_t = table.slice(0, n - test), table.slice(n - test)
        return (Dataset(tuple(memory_tasks(train_t, _block_rows(train_t, blocks)))),
                Dataset(tuple(memory_tasks(test_t, _block_rows(test_t, blocks)))))

    def limit(self, limit: int) -> Dataset:
        """The first `limit` rows (reads blocks only until it has them, and keeps those rows in memory)."""
        import pyarrow as pa

        parts, left = [], limit
        for block in self.iter_blocks():
            if left <= 0:
                break
            parts.append(block.slice(0, left))
            left -= parts[-1].num_rows
        return Dataset(tuple(ReadTask("memory", table=t, rows=t.num_rows) for t in parts) or
                       (ReadTask("memory", table=pa.table({}), rows=0),))

    # -- consuming ---------------------------------------------------------------------

    def count(self) -> int:
        if not self.ops and all(t.rows is not None for t in self.tasks):
            return sum(t.rows or 0 for t in self.tasks)  # parquet footers and memory: nothing to read
        return sum(t.num_rows for t in self.iter_blocks())

    def schema(self) -> Any:
        """The pyarrow schema of the first block (read and transformed)."""
        return self.read_block(0).schema if self.tasks else None

    def columns(self) -> list[str]:
        schema = self.schema()
        return list(schema.names) if schema is not None else []

    def take(self, limit: int = 20) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for block in self.iter_blocks():
            columns = to_batch(block.slice(0, limit - len(rows)), "numpy")
            rows += [{k: v[i] for k, v in columns.items()} for i in range(min(block.num_rows, limit - len(rows)))]
            if len(rows) >= limit:
                break
        return rows

    def take_all(self) -> list[dict[str, Any]]:
        return self.take(2**62)

    def take_batch(self, batch_size: int = 20, *, batch_format: str = "default") -> Any:
        return to_batch(self.limit(batch_size)._table(), check_format(batch_format, "take_batch"))

    def to_pandas(self) -> Any:
        return to_batch(self._table(), "pandas")

    def shard(self, rank: int, world_size: int, *, seed: int | None = None) -> Any:
        """Rank `rank` of `world_size`'s part, as `get_dataset_shard` gives it (an outlast.train.data.DataShard):
        `len // world_size` rows of each epoch, the epoch's rows being its blocks' rows in the epoch's block order
        (shuffled per epoch by `seed`, or by randomize_block_order's), read as slices of this rank's own blocks.
        `data_position()` is where it is; `resume_from({rank: position, ...})`, given every rank's, goes on at
        the next batch, at this world size or another (the rest of the epoch split again)."""
        from outlast.train.data import DataShard, to_source

        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"shard(rank={rank!r}, world_size={world_size!r}): need 0 <= rank < world_size")
        dataset = self if seed is None else replace(self, block_seed=seed)
        return DataShard("dataset", to_source("dataset", dataset), rank, world_size)

    def iter_batches(self, **kwargs: Any) -> Walkable:
        return walk.iter_batches(self, **kwargs)

    def iter_torch_batches(self, **kwargs: Any) -> Walkable:
        return walk.iter_torch_batches(self, **kwargs)

    def iter_rows(self, **_ignored: Any) -> Walkable:
        return walk.iter_rows(self)

    def rows(self) -> Any:
        """For outlast.train.data's shards: the rows by number, read as slices of blocks (see BlockRows)."""
        from outlast.data.block_rows import BlockRows

        return BlockRows(self)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"Dataset.{name} is not supported by outlast: {_ADVICE}")

    def __repr__(self) -> str:
        return f"Dataset(num_blocks={len(self.tasks)}, transforms={[op.kind for op in self.ops]})"


def _names(schema: Any) -> str:
    return "{" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "}"


def _block_rows(table: Any, blocks: int) -> int:
    return max(1, -(-int(table.num_rows) // max(blocks, 1)))
