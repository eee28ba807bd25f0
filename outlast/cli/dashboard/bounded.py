"""The storage the dashboard reads through: every document's size is checked before it is read.

Whoever can write the storage path writes the documents the dashboard reads (run_state.json,
manifests, report segments). Each is read only when its size is within `MAX_DOCUMENT_BYTES`,
taken before the read, and the read itself takes at most one byte past the limit (a file grown
since is refused as well). On a local directory each is opened under the storage root without
following a link. A document refused is a `CorruptDocument`: its run is listed as unreadable,
with the reason, and the rest of the dashboard goes on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from outlast.cli.confined import Refused, open_under, read_at_most
from outlast.storage.base import Storage
from outlast.storage.records import CorruptDocument

# bench/dashboard.py's run of 100 attempts and 10,000 reports is 0.9 MB as one page's document, all told.
MAX_DOCUMENT_BYTES = 16 << 20


class DocumentRefused(CorruptDocument):
    """A document not read: too large, or not a plain file under the storage root."""


def too_large(where: str, size: str, limit: int) -> DocumentRefused:
    return DocumentRefused(f"{where} is {size} bytes, more than the dashboard reads of one document ({limit} "
                           "bytes); it is not shown. outlast writes none this large: look at what wrote it")


class BoundedStorage:
    def __init__(self, inner: Storage, limit: int = MAX_DOCUMENT_BYTES) -> None:
        self.inner, self.limit = inner, limit
        self.root = inner.local_path("")

    def read_bytes(self, path: str) -> bytes:
        where = self.inner.uri(path)
        if self.root is not None:
            try:
                fd = open_under(Path(self.root), path)
            except Refused as e:
                raise DocumentRefused(f"{where} is not read: {e}") from None
            try:
                size = os.fstat(fd).st_size
                if size > self.limit:
                    raise too_large(where, f"{size:,}", self.limit)
                data = read_at_most(fd, self.limit)
            finally:
                os.close(fd)
        else:
            size = self.inner.size(path)
            if size > self.limit:
                raise too_large(where, f"{size:,}", self.limit)
            data = self.inner.read_head(path, self.limit + 1)
        if len(data) > self.limit:
            raise too_large(where, f"more than {self.limit:,}", self.limit)
        return data

    def read_head(self, path: str, n: int) -> bytes:
        """What a bounded reader asks for: the document, checked as `read_bytes` checks it, cut to `n` bytes."""
        return self.read_bytes(path)[:n]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
