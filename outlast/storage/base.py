"""The one small interface the runtime needs from storage.

Paths are '/'-separated and relative to the storage root. Implementations: a local
or network file system (`LocalStorage`); object stores come behind the same methods.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from outlast.protocol.messages import FileEntry


class StorageError(OSError):
    """A storage operation failed; the message names the path."""


class StorageFenced(StorageError):
    """A write refused by this process itself: another driver holds the run. Never retried."""


class Storage(Protocol):
    def upload_dir(self, local_dir: Path, dest: str, move: bool = False, replace: bool = True) -> list[FileEntry]:
        """Copy every file under `local_dir` to `dest/`, returning sizes and checksums (of
        `local_dir`'s copies, whether stored or not).

        `move`: the caller will delete `local_dir` afterwards, so its files may be linked
        into place where storage is the same file system.
        `replace`: each file replaces one already at its place, atomically (a reader sees one
        whole copy). False: a file is created only if none is there, and one that is stays as
        it is, whichever writer comes last; several ranks share a checkpoint directory, and
        only rank 0 replaces."""

    def write_atomic(self, path: str, data: bytes) -> None:
        """Replace `path` with `data` so that a reader sees the old or the new bytes, never a mix."""

    def read_bytes(self, path: str) -> bytes:
        """Raise FileNotFoundError when `path` does not exist."""

    def read_head(self, path: str, n: int) -> bytes:
        """At most the first `n` bytes of `path`: a reader that bounds what it takes (a document from storage
        is whatever its writer made it). Raise FileNotFoundError when `path` does not exist."""

    def exists(self, path: str) -> bool: ...

    def size(self, path: str) -> int:
        """The size of the file at `path`; raise FileNotFoundError when there is none."""

    def list_dirs(self, path: str) -> list[str]:
        """Names of the directories directly under `path` (empty when it does not exist)."""

    def delete(self, path: str) -> None:
        """Remove a file or a directory tree; a missing path is not an error."""

    def download_dir(self, path: str, local_dir: Path) -> dict[str, str]:
        """Copy every file under `path` into `local_dir`. Returns the xxh3-128 digests, by path under
        `local_dir`, of the files it hashed as it wrote them (any, or none), of the bytes written: a check
        of those files against their manifest need not read them again."""

    def local_path(self, path: str) -> Path | None:
        """`path` as a local directory when storage is a file system; None when it must be downloaded."""

    def uri(self, path: str) -> str:
        """How `path` is shown to the user."""
