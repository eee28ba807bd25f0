"""A checkpoint is a directory of files; the user writes it, outlast commits it."""

from __future__ import annotations

import contextlib
import enum
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
        """The checkpoint's files as a local directory; read them, do not change them.

        A checkpoint on remote storage is downloaded to a temporary directory for the block.
        """
        if "://" not in self.path:
            yield self.path
            return
        local = self.to_directory()
        try:
            yield local
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def to_directory(self, path: str | os.PathLike[str] | None = None) -> str:
        """Copy the checkpoint's files into `path` (a new temporary directory by default)."""
        target = Path(path) if path is not None else Path(tempfile.mkdtemp(prefix="outlast_checkpoint_"))
        if "://" in self.path:
            from outlast.storage import open_storage

            open_storage(self.path).download_dir("", target)
            (target / MANIFEST_NAME).unlink(missing_ok=True)
        else:
            shutil.copytree(self.path, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST_NAME))
        return str(target)

    def __repr__(self) -> str:
        return f"Checkpoint(path={self.path!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)


class CheckpointUploadMode(enum.Enum):
    """SYNC: `report()` returns once the checkpoint is committed. ASYNC: it returns at once and
    the files upload in the background (the end of the run waits for them)."""

    SYNC = "SYNC"
    ASYNC = "ASYNC"
