"""Sizes and core counts as users write them: `2GiB`, `512M`, `1.5g`, `1073741824`, `0.5` cores."""

from __future__ import annotations

import re

from outlast.isolation.errors import BadSetting

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
# A bare `M` or `G` means MiB/GiB, as in `free -g`, docker and Kubernetes' older habits;
# `MB`/`GB` are the decimal units. That is what people expect when they reserve memory.
_BINARY_SHORT = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    if isinstance(text, (int, float)):
        if text < 0:
            raise BadSetting(f"{what} must not be negative, got {text}")
        return int(text)
    match = _SIZE.match(str(text))
    if not match:
        raise BadSetting(f"{what} {text!r} is not a size; write e.g. 2GiB, 512MiB, 1.5G or a number of bytes")
    number, unit = float(match.group(1)), match.group(2).lower()
    factor = _BINARY_SHORT.get(unit) or _UNITS.get(unit)
    if factor is None:
        raise BadSetting(f"{what} {text!r} has an unknown unit {match.group(2)!r}; use B, KiB, MiB, GiB, TiB, "
                         "K, M, G, T (binary) or KB, MB, GB, TB (decimal)")
    return int(number * factor)


def parse_cpus(text: str | int | float, what: str = "CPU reservation") -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise BadSetting(f"{what} {text!r} is not a number of cores; write e.g. 1 or 0.5") from None
    if value < 0:
        raise BadSetting(f"{what} must not be negative, got {value}")
    return value


def format_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB") else f"{n:.{0 if unit == 'MiB' else 2}f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
