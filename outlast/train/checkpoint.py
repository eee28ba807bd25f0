"""A checkpoint is a directory of files; the user writes it, outlast commits it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from outlast.storage.records import MANIFEST_NAME


class Checkpoint:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> "Checkpoint":
        if not Path(path).is_dir():
            raise ValueError(f"Checkpoint.from_directory: {path} is not a directory")
        return cls(path)

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """The checkpoint's files as a local directory; read them, do not change them."""
        yield self.path

    def to_directory(self, path: str | os.PathLike[str] | None = None) -> str:
        """Copy the checkpoint's files into `path` (a new temporary directory by default)."""
        target = Path(path) if path is not None else Path(tempfile.mkdtemp(prefix="outlast_checkpoint_"))
        shutil.copytree(self.path, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST_NAME))
        return str(target)

    def __repr__(self) -> str:
        return f"Checkpoint(path={self.path!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)
