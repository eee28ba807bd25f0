"""A block (a pyarrow Table) as the batch formats Ray Data hands to functions, and back.

Columns of equal-shaped arrays are pyarrow fixed-shape tensors, so that a numpy batch of images or
vectors comes back as one n-dimensional array; other columns convert as pyarrow converts them.
"""

from __future__ import annotations

from typing import Any

BATCH_FORMATS = ("default", "numpy", "pandas", "pyarrow")


def check_format(batch_format: str | None, where: str) -> str:
    batch_format = batch_format or "default"
    if batch_format not in BATCH_FORMATS:
        raise ValueError(f"{where}(batch_format={batch_format!r}): use one of {', '.join(BATCH_FORMATS)}")
    return batch_format


def column_to_numpy(column: Any) -> Any:
    import numpy as np
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if isinstance(column.type, pa.FixedShapeTensorType):
        return column.to_numpy_ndarray()
    if pa.types.is_fixed_size_list(column.type) and column.null_count == 0:
        values = column_to_numpy(column.flatten())  # flatten, not .values: a slice's rows only
        return values.reshape(len(column), column.type.list_size, *values.shape[1:])
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        values = column.to_pylist()
        try:
            return np.asarray(values)
        except ValueError:  # ragged: one array per row
            out = np.empty(len(values), dtype=object)
            out[:] = [np.asarray(v) for v in values]
            return out
    return column.to_numpy(zero_copy_only=False)


def to_batch(table: Any, batch_format: str) -> Any:
    if batch_format == "pyarrow":
        return table
    if batch_format == "pandas":
        import pandas as pd

        return pd.DataFrame({name: list(v) if getattr(v, "ndim", 1) > 1 else v
                             for name, v in zip(table.column_names, map(column_to_numpy, table.columns))})
    return {name: column_to_numpy(table.column(name)) for name in table.column_names}


def array_from(values: Any) -> Any:
    """A pyarrow array for a column: n-dimensional arrays become fixed-shape tensors."""
    import numpy as np
    import pyarrow as pa

    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values
    if hasattr(values, "numpy") and hasattr(values, "detach"):  # a torch tensor
        values = values.detach().cpu().numpy()
    if isinstance(values, np.ndarray) and values.ndim > 1 and values.dtype != object:
        values = np.ascontiguousarray(values)
        if values.strides[0] != values.itemsize * int(np.prod(values.shape[1:])):
            values = values.copy()  # a view with a length-1 axis (a[None]) can keep a stride Arrow refuses
        return pa.FixedShapeTensorArray.from_numpy_ndarray(values)
    if isinstance(values, np.ndarray) and values.dtype == object and len(values) and isinstance(values[0], np.ndarray):
        return pa.array([v.tolist() for v in values])
    if isinstance(values, list) and values and isinstance(values[0], np.ndarray):
        return array_from(np.stack(values)) if len({v.shape for v in values}) == 1 else pa.array(
            [v.tolist() for v in values])
    return pa.array(values)


def from_batch(batch: Any, where: str) -> Any:
    """The table a function's returned batch stands for (a dict of columns, a DataFrame or a Table)."""
    import pyarrow as pa

    if isinstance(batch, pa.Table):
        return batch
    if type(batch).__module__.split(".")[0] == "pandas" and hasattr(batch, "columns"):
        return pa.table({str(c): array_from(batch[c].to_numpy()) for c in batch.columns})
    if isinstance(batch, dict):
        lengths = {k: len(v) for k, v in batch.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"{where} returned columns of different lengths {lengths}: return equally long columns")
        return pa.table({str(k): array_from(v) for k, v in batch.items()})
    raise TypeError(f"{where} returned a {type(batch).__name__}: return a dict of columns, a pandas DataFrame "
                    "or a pyarrow Table")


def from_rows(rows: list[dict[str, Any]], where: str) -> Any:
    import pyarrow as pa

    if not rows:
        return pa.table({})
    for row in rows:
        if not isinstance(row, dict):
            raise TypeError(f"{where} gave a row of type {type(row).__name__}: rows are dicts of column -> value")
    keys = list(rows[0])
    return from_batch({k: [row.get(k) for row in rows] for k in keys}, where)


def rows_of(table: Any) -> list[dict[str, Any]]:
    columns = to_batch(table, "numpy")
    return [{k: v[i] for k, v in columns.items()} for i in range(table.num_rows)]
