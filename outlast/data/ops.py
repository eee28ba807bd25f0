"""The per-block transforms of a dataset: each takes a block (a pyarrow Table) and returns one.

A function that raises is reported with its name and the block it was given; its own traceback is
kept as the cause. A callable class is built once per process, on its first block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from outlast.data.batches import check_format, from_batch, from_rows, rows_of, to_batch
from outlast.data.errors import UserFunctionError


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


@dataclass
class Op:
    """One transform: `kind` says what it does with `fn` (map, map_batches, filter, flat_map, columns)."""

    kind: str
    fn: Any = None
    batch_format: str = "default"
    batch_size: int | None = None
    fn_args: tuple[Any, ...] = ()
    fn_kwargs: dict[str, Any] = field(default_factory=dict)
    ctor_args: tuple[Any, ...] = ()
    ctor_kwargs: dict[str, Any] = field(default_factory=dict)
    columns: tuple[str, ...] = ()
    _instance: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_instance"] = None  # each process builds its own instance of a callable class
        return state

    def _callable(self) -> Any:
        if not isinstance(self.fn, type):
            return self.fn
        if self._instance is None:
            try:
                self._instance = self.fn(*self.ctor_args, **self.ctor_kwargs)
            except Exception as e:  # noqa: BLE001 - the user's constructor
                raise UserFunctionError(f"{self.kind}: constructing {_name(self.fn)} raised {type(e).__name__}: {e}; "
                                        "see the traceback above") from e
        return self._instance

    def apply(self, table: Any, label: str) -> Any:
        import pyarrow as pa

        if self.kind == "select_columns":
            return table.select(list(self.columns))
        if self.kind == "drop_columns":
            return table.drop_columns(list(self.columns))
        fn = self._callable()
        where = f"{self.kind}({_name(self.fn)})"
        try:
            if self.kind == "map_batches":
                size = self.batch_size or max(table.num_rows, 1)
                out = [from_batch(fn(to_batch(table.slice(s, size), self.batch_format), *self.fn_args,
                                     **self.fn_kwargs), where) for s in range(0, table.num_rows, size)]
                return pa.concat_tables(out) if out else table
            if self.kind == "add_column":
                column = fn(to_batch(table, self.batch_format))
                return from_batch({**to_batch(table, "numpy"), self.columns[0]: column}, where) \
                    if self.batch_format != "pyarrow" else table.append_column(self.columns[0], pa.array(column))
            rows = rows_of(table)
            if self.kind == "map":
                return from_rows([fn(r, *self.fn_args, **self.fn_kwargs) for r in rows], where) if rows else table
            if self.kind == "filter":
                keep = [bool(fn(r, *self.fn_args, **self.fn_kwargs)) for r in rows]
                return table.filter(pa.array(keep, pa.bool_())) if rows else table
            if self.kind == "flat_map":
                out_rows = [o for r in rows for o in fn(r, *self.fn_args, **self.fn_kwargs)]
                return from_rows(out_rows, where) if out_rows else table.slice(0, 0)
        except UserFunctionError:
            raise
        except (TypeError, ValueError) as e:
            if str(e).startswith(where):  # our own message about what the function returned
                raise
            raise UserFunctionError(f"{where} raised {type(e).__name__}: {e} on {label}; see the traceback "
                                    "above") from e
        except Exception as e:  # noqa: BLE001 - the user's function
            raise UserFunctionError(f"{where} raised {type(e).__name__}: {e} on {label}; see the traceback "
                                    "above") from e
        raise ValueError(f"unknown transform {self.kind}")


def batch_op(fn: Any, batch_format: str | None, batch_size: Any, fn_args: tuple[Any, ...], fn_kwargs: dict[str, Any] | None,
             ctor_args: tuple[Any, ...], ctor_kwargs: dict[str, Any] | None) -> Op:
    if batch_size == "default":
        batch_size = None
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"map_batches(batch_size={batch_size!r}): give a positive number of rows, or None for "
                         "whole blocks")
    if isinstance(fn, type) is False and (ctor_args or ctor_kwargs):
        raise ValueError("map_batches(fn_constructor_args=...) is for a callable class; fn is a function")
    return Op("map_batches", fn, check_format(batch_format, "map_batches"), batch_size, tuple(fn_args or ()),
              dict(fn_kwargs or {}), tuple(ctor_args or ()), dict(ctor_kwargs or {}))
