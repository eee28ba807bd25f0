"""The blocks of a read: one per parquet row group, one per file of the other formats, or one per chunk
of in-memory data. A block is read when a shard reaches it, never before."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from outlast.data.batches import array_from, from_batch
from outlast.data.errors import DataReadError
from outlast.data.files import FileRef, list_files

_FIX = {
    "parquet": "check that it is a whole parquet file (re-write it, or remove it from the directory)",
    "csv": "check that it is comma-separated text with a header row",
    "json": "check that it holds one JSON object per line (or pass lines=False for a JSON array)",
    "text": "check that it is UTF-8 text",
    "numpy": "check that it was written with numpy.save",
    "binary": "check that it can be read",
    "images": "check that it is an image Pillow can open (JPEG, PNG, ...), or remove it from the directory",
}


@dataclass(frozen=True)
class ReadTask:
    """How to make one block: a format with a file (and row group), or rows kept in memory."""

    kind: str
    file: FileRef | None = None
    row_group: int | None = None
    options: tuple[tuple[str, Any], ...] = ()
    table: Any = field(default=None, compare=False)  # kind "memory"
    rows: int | None = None  # known without reading (parquet metadata, memory)

    @property
    def label(self) -> str:
        if self.file is None:
            return "in-memory block"
        return self.file.uri + (f" (row group {self.row_group})" if self.row_group is not None else "")

    def read(self) -> Any:
        if self.kind == "memory":
            return self.table
        assert self.file is not None
        try:
            return _READERS[self.kind](self.file, self.row_group, dict(self.options))
        except DataReadError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of a format's reader is this file's
            raise DataReadError(f"{self.label}: could not be read as {self.kind} ({type(e).__name__}: {e}); "
                                f"{_FIX[self.kind]}") from e


def _open(file: FileRef) -> Any:
    return file.filesystem().open_input_file(file.path)


def _parquet(file: FileRef, row_group: int | None, options: dict[str, Any]) -> Any:
    import pyarrow.parquet as pq

    with _open(file) as f:
        reader = pq.ParquetFile(f)
        return reader.read_row_group(row_group or 0, columns=options.get("columns"))


def _csv(file: FileRef, _rg: int | None, options: dict[str, Any]) -> Any:
    import pyarrow.csv as pcsv

    with _open(file) as f:
        return pcsv.read_csv(f, parse_options=pcsv.ParseOptions(delimiter=options.get("delimiter", ",")))


def _json(file: FileRef, _rg: int | None, options: dict[str, Any]) -> Any:
    import json

    import pyarrow.json as pjson

    with _open(file) as f:
        if options.get("lines", True):
            return pjson.read_json(f)
        data = json.loads(f.read().decode())
    from outlast.data.batches import from_rows

    return from_rows(data if isinstance(data, list) else [data], f"read_json({file.uri!r})")


def _text(file: FileRef, _rg: int | None, options: dict[str, Any]) -> Any:
    import pyarrow as pa

    with _open(file) as f:
        text = f.read().decode(options.get("encoding", "utf-8"))
    lines = text.splitlines()
    if options.get("drop_empty_lines", True):
        lines = [line for line in lines if line.strip()]
    return pa.table({"text": pa.array(lines, pa.string())})


def _numpy(file: FileRef, _rg: int | None, _options: dict[str, Any]) -> Any:
    import numpy as np

    with _open(file) as f:
        array = np.load(io.BytesIO(f.read()), allow_pickle=False)
    return from_batch({"data": array}, f"read_numpy({file.uri!r})")


def _binary(file: FileRef, _rg: int | None, options: dict[str, Any]) -> Any:
    import pyarrow as pa

    with _open(file) as f:
        data = f.read()
    columns = {"bytes": pa.array([data], pa.binary())}
    if options.get("include_paths"):
        columns["path"] = pa.array([file.uri])
    return pa.table(columns)


def _images(file: FileRef, _rg: int | None, options: dict[str, Any]) -> Any:
    import numpy as np
    from PIL import Image

    with _open(file) as f:
        data = f.read()
    image = Image.open(io.BytesIO(data))
    if options.get("mode"):
        image = image.convert(options["mode"])
    if options.get("size"):
        height, width = options["size"]
        image = image.resize((width, height))
    array = np.asarray(image)
    columns: dict[str, Any] = {"image": array_from(array[None, ...])}
    if options.get("include_paths"):
        columns["path"] = [file.uri]
    return from_batch(columns, f"read_images({file.uri!r})")


_READERS = {"parquet": _parquet, "csv": _csv, "json": _json, "text": _text, "numpy": _numpy,
            "binary": _binary, "images": _images}
_EXTENSIONS: dict[str, tuple[str, ...] | None] = {
    "parquet": (".parquet",), "csv": (".csv",), "json": (".json", ".jsonl"), "text": None, "numpy": (".npy",),
    "binary": None, "images": (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".gif")}


def file_tasks(kind: str, paths: Any, read: str, **options: Any) -> list[ReadTask]:
    """The blocks of files of one format; parquet is split into its row groups (read from the footers)."""
    files = list_files(paths, _EXTENSIONS[kind], read)
    frozen = tuple(sorted((k, v) for k, v in options.items() if v is not None))
    if kind != "parquet":
        return [ReadTask(kind, f, options=frozen) for f in files]
    import pyarrow.parquet as pq

    tasks, first_schema = [], None
    for f in files:
        try:
            with _open(f) as handle:
                meta = pq.ParquetFile(handle).metadata
                schema = meta.schema.to_arrow_schema()
        except Exception as e:  # noqa: BLE001 - a file that has no readable footer
            raise DataReadError(f"{read}: {f.uri} could not be read as parquet ({type(e).__name__}: {e}); "
                                f"{_FIX['parquet']}") from e
        if options.get("columns"):
            schema = _project(schema, options["columns"], f, read)
        if first_schema is None:
            first_schema = (f, schema)
        elif not schema.equals(first_schema[1]):
            raise DataReadError(f"{read}: {f.uri} has the schema {_describe(schema)} but {first_schema[0].uri} has "
                                f"{_describe(first_schema[1])}; read files with the same columns and types "
                                "(or pass columns=[...] naming the ones they share)")
        tasks += [ReadTask(kind, f, rg, frozen, rows=meta.row_group(rg).num_rows) for rg in range(meta.num_row_groups)]
    return tasks


def _project(schema: Any, columns: list[str], f: FileRef, read: str) -> Any:
    import pyarrow as pa

    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise DataReadError(f"{read}: {f.uri} has no columns {missing}; it has {schema.names}")
    return pa.schema([schema.field(c) for c in columns])


def _describe(schema: Any) -> str:
    return "{" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "}"


def memory_tasks(table: Any, block_rows: int | None = None) -> list[ReadTask]:
    """In-memory data cut into blocks of `block_rows` rows (about 16 blocks by default, so that ranks share it)."""
    n = table.num_rows
    size = block_rows or max(1, -(-n // 16))
    return [ReadTask("memory", table=table.slice(s, size), rows=min(size, n - s)) for s in range(0, n, size)] or [
        ReadTask("memory", table=table, rows=0)]
