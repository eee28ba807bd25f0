"""The errors a dataset raises: each names the file or function at fault and what to do."""

from __future__ import annotations


class DataReadError(ValueError):
    """A file could not be found or read as its format."""


class UserFunctionError(RuntimeError):
    """A function given to map/map_batches/filter/flat_map raised; its traceback is the cause (`__cause__`)."""
