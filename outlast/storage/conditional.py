"""Compare-and-swap on storage: write a small document only if it is still the version we read.

Each store does it its own way: a file system under a POSIX lock (which NFS keeps too), S3
with conditional PUTs (If-None-Match: * to create, If-Match: ETag to replace), GCS with
generation preconditions (ifGenerationMatch). The driver lease is built on this alone.

The documents are small, and whoever can write the storage path may make one large: a read takes at
most `SMALL + 1` bytes, with the version of the whole document, so a caller tells a document cut
short by its length (`Versioned.whole`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, runtime_checkable

from outlast.storage.base import Storage, StorageError
from outlast.storage.records import MAX_SMALL_DOCUMENT_BYTES

if TYPE_CHECKING:
    from outlast.storage.remote import RemoteStorage

log = logging.getLogger("outlast.storage")


SMALL = MAX_SMALL_DOCUMENT_BYTES


class Versioned(NamedTuple):
    data: bytes  # the document, or its first SMALL + 1 bytes
    version: str  # opaque: whatever the store compares (a digest, an ETag, a generation)

    @property
    def whole(self) -> bool:
        return len(self.data) <= SMALL


def _digest_version(head: bytes, size: int) -> str:
    """A version for stores that have none: the digest of a small document; of a larger one, its size with the
    digest of its head (any change a writer of a small document makes changes it)."""
    if len(head) <= SMALL:
        return hashlib.sha256(head).hexdigest()
    return f"{size}:{hashlib.sha256(head).hexdigest()}"


@runtime_checkable
class ConditionalStore(Protocol):
    def read_versioned(self, path: str) -> Versioned | None:
        """The document and its version, read together; None when it does not exist."""

    def write_if(self, path: str, data: bytes, expected: str | None) -> str | None:
        """Write only if the document is still at version `expected` (None: only if it does not
        exist), and return the new version; None when another writer got there first.
        `StorageError` when storage fails."""


def conditional(storage: Storage) -> ConditionalStore:
    from outlast.storage.local import LocalStorage
    from outlast.storage.remote import RemoteStorage

    if isinstance(storage, LocalStorage):
        return LocalConditional(storage.root)
    if isinstance(storage, RemoteStorage) and storage.protocol in ("s3", "s3a"):
        return S3Conditional(storage)
    if isinstance(storage, RemoteStorage) and storage.protocol in ("gs", "gcs"):
        return GCSConditional(storage)
    if isinstance(storage, ConditionalStore):  # a store that does it itself
        return storage
    return WriteThenCheck(storage)


_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


def _thread_lock(key: str) -> threading.Lock:
    with _thread_locks_guard:
        return _thread_locks.setdefault(key, threading.Lock())


class LocalConditional:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @contextlib.contextmanager
    def _locked(self, target: Path) -> Iterator[None]:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock_path = target.parent / f".{target.name}.lock"
        with _thread_lock(str(lock_path)):
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                # Between processes here; on NFS the client turns it into a lock its server keeps,
                # between machines. Between threads of one process: the lock above.
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def read_versioned(self, path: str) -> Versioned | None:
        try:
            with (self.root / path).open("rb") as f:
                head = f.read(SMALL + 1)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return None
        return Versioned(head, _digest_version(head, size))

    def write_if(self, path: str, data: bytes, expected: str | None) -> str | None:
        from outlast.storage.local import LocalStorage

        target = self.root / path
        try:
            with self._locked(target):
                current = self.read_versioned(path)
                if (current.version if current else None) != expected:
                    return None
                LocalStorage(self.root).write_atomic(path, data)
                return _digest_version(data[:SMALL + 1], len(data))
        except OSError as e:
            raise StorageError(f"could not write {target}: {e}") from e


class WriteThenCheck:
    """For a store outlast has no compare-and-swap for: compare, write, read back. Two writers
    racing within one round trip can both succeed, so this says so once."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        log.warning("storage %s: outlast has no compare-and-swap for it (it has for file systems, s3:// and "
                    "gs://); two drivers started on one run at the same moment might both drive it",
                    storage.uri(""))

    def read_versioned(self, path: str) -> Versioned | None:
        try:
            head = self.storage.read_head(path, SMALL + 1)
            size = self.storage.size(path) if len(head) > SMALL else len(head)
        except FileNotFoundError:
            return None
        return Versioned(head, _digest_version(head, size))

    def write_if(self, path: str, data: bytes, expected: str | None) -> str | None:
        current = self.read_versioned(path)
        if (current.version if current else None) != expected:
            return None
        self.storage.write_atomic(path, data)
        after = self.read_versioned(path)
        return after.version if after is not None and after.data == data[:SMALL + 1] else None


def _precondition_failed(e: BaseException) -> bool:
    """An S3 or GCS answer that means 'someone else wrote it first' (412, or 409 for a race)."""
    text = f"{type(e).__name__} {e}"
    code = getattr(e, "code", None) or getattr(e, "status", None)
    return code in (409, 412) or any(s in text for s in (
        "PreconditionFailed", "Precondition Failed", "pre-conditions you specified did not hold",
        "ConditionalRequestConflict"))


class S3Conditional:
    def __init__(self, storage: RemoteStorage) -> None:
        self.storage = storage

    def _bucket_key(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.storage.fs.split_path(self.storage._p(path))
        return bucket, key

    def read_versioned(self, path: str) -> Versioned | None:
        from fsspec.asyn import sync

        fs = self.storage.fs
        bucket, key = self._bucket_key(path)

        async def get() -> Versioned:
            # One GET returns the body and the ETag of that same body.
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key)
            async with resp["Body"] as body:
                # A read of n bytes returns what has arrived, up to n: read until n or the end, else a lease cut
                # short by the network would read as unreadable, that is as no lease, and a second driver win.
                head = b""
                while len(head) <= SMALL:
                    chunk = await body.read(SMALL + 1 - len(head))
                    if not chunk:
                        break
                    head += chunk
                return Versioned(head, resp["ETag"])

        try:
            versioned: Versioned = sync(fs.loop, get)
            return versioned
        except FileNotFoundError:
            return None
        except Exception as e:
            raise StorageError(f"could not read {self.storage.uri(path)}: {e}") from e

    def write_if(self, path: str, data: bytes, expected: str | None) -> str | None:
        from fsspec.asyn import sync

        fs = self.storage.fs
        bucket, key = self._bucket_key(path)
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        try:
            etag: str = sync(fs.loop, fs._call_s3, "put_object", Bucket=bucket, Key=key, Body=data, **condition)["ETag"]
            return etag
        except Exception as e:
            if _precondition_failed(e):
                return None
            raise StorageError(f"could not write {self.storage.uri(path)}: {e}") from e


def gcs_upload_params(name: str, expected: str | None) -> dict[str, str | int]:
    """The JSON API's media upload with its precondition: generation 0 means 'does not exist'."""
    return {"uploadType": "media", "name": name, "ifGenerationMatch": 0 if expected is None else int(expected)}


_Answer = tuple[Mapping[str, str], bytes]  # (headers, body) of a JSON API call


class GCSConditional:
    def __init__(self, storage: RemoteStorage, call: Callable[..., _Answer] | None = None) -> None:
        self.storage = storage
        # (method, url, *url_args, **params) -> (headers, body), raising as gcsfs does (404:
        # FileNotFoundError; 412: an error whose `code` is 412). gcsfs's own by default.
        self._call = call

    def _do(self, method: str, url: str, *args: str, **kw: Any) -> _Answer:
        if self._call is not None:
            return self._call(method, url, *args, **kw)
        from fsspec.asyn import sync

        fs = self.storage.fs
        answer: _Answer = sync(fs.loop, fs._call, method, url, *args, **kw)
        return answer

    def _bucket_key(self, path: str) -> tuple[str, str]:
        full = self.storage._p(path)
        bucket, _, key = full.partition("/")
        return bucket, key

    def read_versioned(self, path: str) -> Versioned | None:
        bucket, key = self._bucket_key(path)
        url = "https://storage.googleapis.com/storage/v1/b/{}/o/{}"
        try:
            try:
                # At most SMALL + 1 bytes, as from S3: a document past that is refused unread, never taken whole.
                headers, body = self._do("GET", url, bucket, key, alt="media",
                                         headers={"Range": f"bytes=0-{SMALL}"})
            except Exception as e:
                if getattr(e, "code", None) != 416:
                    raise
                # An empty object has no byte 0 to range over: read it, all nothing of it.
                headers, body = self._do("GET", url, bucket, key, alt="media")
        except FileNotFoundError:
            return None
        except Exception as e:
            raise StorageError(f"could not read {self.storage.uri(path)}: {e}") from e
        # The generation of the bytes returned, from the same response.
        return Versioned(body[:SMALL + 1], str(headers["x-goog-generation"]))

    def write_if(self, path: str, data: bytes, expected: str | None) -> str | None:
        bucket, key = self._bucket_key(path)
        try:
            _headers, body = self._do("POST", "https://storage.googleapis.com/upload/storage/v1/b/{}/o",
                                               bucket, data=data, **gcs_upload_params(key, expected))
            return str(json.loads(body)["generation"])
        except Exception as e:
            if _precondition_failed(e):
                return None
            raise StorageError(f"could not write {self.storage.uri(path)}: {e}") from e
