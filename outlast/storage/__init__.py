"""Where runs live: `open_storage()` turns a `storage_path` into a `Storage`."""

from __future__ import annotations

import os

from outlast.storage.base import Storage, StorageError


def open_storage(storage_path: str | os.PathLike[str]) -> Storage:
    """A plain path, file:// or local:// (fsspec's name for it) is a local (or network) file system; any other
    URL goes through fsspec."""
    text = os.fspath(storage_path)
    for scheme in ("file://", "local://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    if "://" not in text:
        from outlast.storage.local import LocalStorage

        return LocalStorage(text)
    from outlast.storage.remote import RemoteStorage

    return RemoteStorage(text)


__all__ = ["Storage", "StorageError", "open_storage"]
