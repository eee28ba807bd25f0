"""What `report(metrics)` accepts: what JSON keeps as it is, since a run's metrics live in its history on storage.

Ray Train keeps the metrics of a running fit() as Python objects, but what it writes to storage goes through
JSON; outlast's Result is read from storage alone (a relaunched driver builds the same one), so a value that
JSON would turn into something else is refused at the report, naming it, rather than changed without a word:
a set would come back a list, bytes a base64 string, a datetime or an object of the user's not at all. As
`json.dumps` does, a tuple is kept as a list. NumPy and torch scalars and arrays are kept as their Python
values (`.item()`, `.tolist()`); NaN and the infinities are kept too (outlast/storage/metric_values.py).
"""

from __future__ import annotations

from typing import Any

_PLAIN = (str, int, float, bool, type(None))


def check_metrics(metrics: dict[str, Any]) -> None:
    """Raise TypeError naming the first value (by its key path) that the run's history cannot keep."""
    if not isinstance(metrics, dict):
        raise TypeError(f"report(metrics=...) takes a dict, got {type(metrics).__name__}")
    _check(metrics, "metrics")


def _check(value: Any, where: str) -> None:
    if isinstance(value, _PLAIN) or _is_array_like(value):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"report(metrics=...): {where} has the key {key!r} of type {type(key).__name__}; "
                                f"metric names are strings (write str({key!r}))")
            _check(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check(item, f"{where}[{i}]")
        return
    hint = " (report sorted(...) or list(...) of it)" if isinstance(value, (set, frozenset)) else ""
    raise TypeError(f"report(metrics=...): {where} is a {type(value).__name__}{hint}, which the run's history "
                    "cannot keep as it is: metrics are numbers, strings, booleans, None, and lists and dicts of them "
                    "(NumPy and torch values too)")


def _is_array_like(value: Any) -> bool:
    # NumPy and torch scalars and arrays: sent as their Python value (outlast/protocol/transport.py).
    return callable(getattr(value, "item", None)) or callable(getattr(value, "tolist", None))
