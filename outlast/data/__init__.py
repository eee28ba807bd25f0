"""Ray Data's reads and transforms, on pyarrow, streamed a block at a time.

    ds = outlast.data.read_parquet("s3://bucket/train/")      # nothing read yet
    ds = ds.map_batches(normalize, batch_format="numpy")
    shard = ds.shard(rank, world_size, seed=7)                # len // world_size rows, from its own blocks
    for batch in shard.iter_torch_batches(batch_size=64):     # walkable again, once per epoch
        ...
    position = shard.data_position()                          # resume_from({rank: position, ...})
"""

from __future__ import annotations

from typing import Any

from outlast.data.dataset import Dataset
from outlast.data.errors import DataReadError, UserFunctionError
from outlast.data.readers import file_tasks, memory_tasks

__all__ = ["Dataset", "DataReadError", "UserFunctionError", "from_huggingface", "from_items",
           "from_numpy", "from_pandas", "from_torch", "read_binary_files", "read_csv", "read_images", "read_json",
           "read_numpy", "read_parquet", "read_text"]


def read_parquet(paths: Any, *, columns: list[str] | None = None, **_ignored: Any) -> Dataset:
    """One block per row group of each file."""
    return Dataset(tuple(file_tasks("parquet", paths, "read_parquet", columns=columns)))


def read_csv(paths: Any, *, delimiter: str | None = None, **_ignored: Any) -> Dataset:
    return Dataset(tuple(file_tasks("csv", paths, "read_csv", delimiter=delimiter)))


def read_json(paths: Any, *, lines: bool | None = None, **_ignored: Any) -> Dataset:
    """JSON Lines files (one object per line), or, with lines=False, files holding an array of objects."""
    return Dataset(tuple(file_tasks("json", paths, "read_json", lines=lines)))


def read_text(paths: Any, *, encoding: str = "utf-8", drop_empty_lines: bool = True, **_ignored: Any) -> Dataset:
    """A row {"text": line} per line."""
    return Dataset(tuple(file_tasks("text", paths, "read_text", encoding=encoding,
                                    drop_empty_lines=drop_empty_lines)))


def read_numpy(paths: Any, **_ignored: Any) -> Dataset:
    """A row {"data": array[i]} per first-axis entry of each .npy file."""
    return Dataset(tuple(file_tasks("numpy", paths, "read_numpy")))


def read_binary_files(paths: Any, *, include_paths: bool = False, **_ignored: Any) -> Dataset:
    """A row {"bytes": ...} (and "path") per file."""
    return Dataset(tuple(file_tasks("binary", paths, "read_binary_files", include_paths=include_paths)))


def read_images(paths: Any, *, size: tuple[int, int] | None = None, mode: str | None = None,
                include_paths: bool = False, **_ignored: Any) -> Dataset:
    """A row {"image": HxWxC uint8 array} (and "path") per image file; needs Pillow."""
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        raise ImportError("read_images needs Pillow to decode images: pip install pillow") from None
    return Dataset(tuple(file_tasks("images", paths, "read_images", size=tuple(size) if size else None, mode=mode,
                                    include_paths=include_paths)))


def _memory(table: Any, override_num_blocks: int | None) -> Dataset:
    rows = -(-table.num_rows // override_num_blocks) if override_num_blocks else None
    return Dataset(tuple(memory_tasks(table, rows)))


def from_items(items: list[Any], *, override_num_blocks: int | None = None, **_ignored: Any) -> Dataset:
    """Rows from a list: dicts are rows, anything else becomes {"item": value}."""
    from outlast.data.batches import from_rows

    rows = [item if isinstance(item, dict) else {"item": item} for item in items]
    return _memory(from_rows(rows, "from_items"), override_num_blocks)


def from_pandas(dfs: Any, *, override_num_blocks: int | None = None, **_ignored: Any) -> Dataset:
    import pyarrow as pa

    from outlast.data.batches import from_batch

    frames = dfs if isinstance(dfs, list) else [dfs]
    return _memory(pa.concat_tables([from_batch(df, "from_pandas") for df in frames]), override_num_blocks)


def from_numpy(ndarrays: Any, **_ignored: Any) -> Dataset:
    """A row {"data": array[i]} per first-axis entry."""
    import numpy as np

    from outlast.data.batches import from_batch

    arrays = ndarrays if isinstance(ndarrays, list) else [ndarrays]
    return _memory(from_batch({"data": np.concatenate(arrays)}, "from_numpy"), None)


def from_torch(dataset: Any, **_ignored: Any) -> Dataset:
    """A row {"item": dataset[i]} per item of a map-style torch Dataset (read into memory, as Ray does)."""
    return from_items([{"item": _plain(dataset[i])} for i in range(len(dataset))])


def _plain(value: Any) -> Any:
    """A torch item as values Arrow holds: tensors as numpy, tuples (TensorDataset's rows) as lists."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        array = value.detach().cpu().numpy()
        return array.item() if array.ndim == 0 else array
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def from_huggingface(dataset: Any, **_ignored: Any) -> Dataset:
    """The columns of a Hugging Face datasets.Dataset, from its Arrow table."""
    table = dataset.with_format(None).data
    table = getattr(table, "table", table)
    if dataset._indices is not None:  # a selected or shuffled view: its rows, in its order
        table = table.take(dataset._indices.column(0))
    return _memory(table, None)
