"""Metric values as JSON keeps them: a non-finite float is stored as a string, and read back as the float.

JSON has no NaN or infinity, and msgspec (as most encoders) writes them as `null`, which would make a
diverging loss vanish from a run's history. So every document outlast writes stores them as the
strings "NaN", "Infinity" and "-Infinity" (docs/json.md), and every reader of metrics (Result, the
dashboard, `outlast runs`, a worker's `get_all_reported_checkpoints()`) gives back the float. A metric
that is one of those strings itself reads back as the float too: the one thing this spelling cannot tell.
"""

from __future__ import annotations

import math
from typing import Any, Callable

NAMES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _name(x: float) -> str:
    return "NaN" if math.isnan(x) else "Infinity" if x > 0 else "-Infinity"


def stored(value: Any) -> Any:
    """`value` with each non-finite float (in lists and dicts too) replaced by its name; `value` itself,
    the same object, when it holds none."""
    if isinstance(value, float):
        return value if math.isfinite(value) else _name(value)
    return _walk(value, stored)


def restored(value: Any) -> Any:
    """The inverse of `stored`: each "NaN", "Infinity" or "-Infinity" string becomes the float."""
    if isinstance(value, str):
        return NAMES.get(value, value)
    return _walk(value, restored)


def _walk(value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, dict):
        out = {k: fn(v) for k, v in value.items()}
        return value if all(out[k] is v for k, v in value.items()) else out
    if isinstance(value, (list, tuple)):
        items = [fn(v) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else items
    return value
