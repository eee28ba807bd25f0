"""A checkpoint is a directory of files; the user writes it, outlast commits it."""

from __future__ import annotations

import contextlib
import enum
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outlast.storage.records import MANIFEST_NAME

METADATA_NAME = ".metadata.json"  # where Ray keeps a checkpoint's metadata, so a directory reads the same on both


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

    def get_metadata(self) -> dict[str, Any]:
        """The dict saved with `set_metadata`, in the checkpoint's own files ({} without one)."""
        from outlast.storage import open_storage
        from outlast.storage.run_store import read_document

        storage = open_storage(self.path)
        try:
            data = read_document(storage, METADATA_NAME)  # bounded: the files are anyone's who can write there
        except FileNotFoundError:
            return {}
        try:
            metadata = json.loads(data)
        except ValueError as e:
            raise ValueError(f"{storage.uri(METADATA_NAME)} is not JSON ({e}): the checkpoint's metadata was "
                             "written by something other than set_metadata") from None
        if not isinstance(metadata, dict):
            raise ValueError(f"{storage.uri(METADATA_NAME)} holds a {type(metadata).__name__}, not the dict "
                             "set_metadata writes")
        return metadata

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Save `metadata` (JSON) with the checkpoint's files; call it before `report()`."""
        self._write_metadata(metadata)

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        self._write_metadata({**self.get_metadata(), **metadata})

    def _write_metadata(self, metadata: dict[str, Any]) -> None:
        if not isinstance(metadata, dict):
            raise TypeError(f"Checkpoint metadata must be a dict, got {type(metadata).__name__}")
        if "://" in self.path or (Path(self.path) / MANIFEST_NAME).exists():
            raise ValueError(f"{self.path} is a committed checkpoint, which does not change (its files are checked "
                             "against its manifest on restore): set metadata on the directory before report()")
        try:
            data = json.dumps(metadata)
        except TypeError as e:
            raise TypeError(f"Checkpoint metadata must be JSON-serializable: {e}") from None
        (Path(self.path) / METADATA_NAME).write_text(data)

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


class CheckpointConsistencyMode(enum.Enum):
    """What `get_all_reported_checkpoints()` waits for. outlast has no validation step, so both mean
    the checkpoints committed when the call is made."""

    COMMITTED = "COMMITTED"
    VALIDATED = "VALIDATED"


class ReportedCheckpointStatus(enum.Enum):
    COMMITTED = "COMMITTED"


@dataclass
class ReportedCheckpoint:
    checkpoint: Checkpoint
    metrics: dict[str, Any]
    status: ReportedCheckpointStatus = ReportedCheckpointStatus.COMMITTED
