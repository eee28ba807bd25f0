"""Storage on anything fsspec reaches: s3://, gs://, and the rest.

Credentials and endpoints come the usual way for each file system (for S3: the AWS
environment variables and config files, `AWS_ENDPOINT_URL` for S3-compatible servers).
"""

from __future__ import annotations

import os
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

from outlast.faults import fault_point
from outlast.protocol import paths
from outlast.protocol.messages import FileEntry
from outlast.storage.base import StorageError
from outlast.storage.checksum import ALGORITHM, hash_file
from outlast.storage.conditional import _precondition_failed
from outlast.storage import priority, s3_bulk
from outlast.storage.local import walk_files
from outlast.storage.priority import io_pool
from outlast.storage.range_digest import RangeDigest

if TYPE_CHECKING:
    from collections.abc import Callable

    from _typeshed import ReadableBuffer as Buffer
    from fsspec import AbstractFileSystem

_RANGE = 32 << 20  # through fsspec, a file over twice this size is fetched in ranges of it, in parallel


class RemoteStorage:
    def __init__(self, url: str) -> None:
        import fsspec

        protocol, _, rest = url.partition("://")
        if not rest.strip("/"):
            raise ValueError(f"storage_path {url!r} names no bucket or directory")
        try:
            fs_class = fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as e:
            raise ValueError(f"storage_path {url!r}: no file system for '{protocol}://' ({e}); "
                             f"for s3:// run `pip install s3fs`, for gs:// `pip install gcsfs`") from None
        self.url = url.rstrip("/")
        self.protocol = protocol
        # The file system says what its paths look like: a bucket and key for s3://, an absolute
        # path for local:///abs, whose leading slash is the path's own.
        self.root = fs_class._strip_protocol(self.url).rstrip("/") or "/"
        self._fs: AbstractFileSystem | None = None
        self._bulk_client: s3_bulk.BulkClient | None = None

    def __getstate__(self) -> dict[str, str | None]:
        return {"url": self.url, "protocol": self.protocol, "root": self.root, "_fs": None, "_bulk_client": None}

    @property
    def fs(self) -> AbstractFileSystem:
        if self._fs is None:
            import fsspec

            # Listings must never come from a cache: other processes write the same run.
            self._fs = fsspec.filesystem(self.protocol, use_listings_cache=False, skip_instance_cache=True)
        return self._fs

    def _p(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def upload_dir(self, local_dir: Path, dest: str, move: bool = False, replace: bool = True) -> list[FileEntry]:
        """Files in parallel, each a multipart upload with parts in parallel once it is large (on S3
        through object_store, `s3_bulk`, where obstore is installed; elsewhere fsspec's put_file); each
        file's xxh3 is taken from the page cache beside its upload.
        A restore compares the downloaded bytes with it. A PUT replaces an object whole;
        `replace=False` makes it conditional (see `_create`)."""
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise StorageError(f"checkpoint directory {local_dir} does not exist or is not a directory")
        try:
            self._bulk()  # made here, once, before the files' threads ask for it
        except Exception as e:
            raise StorageError(f"could not reach {self.uri(dest)}: {e}") from e
        jobs = []
        for rel in walk_files(local_dir)[0]:
            src = local_dir / rel
            jobs.append((rel, src, priority.submit(self._put if replace else self._create, str(src), self._p(f"{dest}/{rel}")),
                         priority.submit(hash_file, src, ALGORITHM)))
        entries = []
        try:
            for rel, src, put, digest in jobs:
                try:
                    put.result()
                    size, hexdigest = digest.result()
                except Exception as e:  # botocore and aiohttp raise their own types
                    # The upload has failed: the files not begun yet are not begun (each would try, and retry,
                    # against the same store), and those on their way are waited for below.
                    for _, _, other_put, other_digest in jobs:
                        other_put.cancel()
                        other_digest.cancel()
                    raise StorageError(f"could not upload {src} to {self.uri(f'{dest}/{rel}')}: {e}") from e
                entries.append(FileEntry(path=rel, size=size, xxh3_128=hexdigest))
                fault_point("upload.mid")  # other files may still be on their way: a crash mid-upload
        finally:
            futures.wait([put for _, _, put, _ in jobs])
            futures.wait([digest for *_, digest in jobs])
        return entries

    def _put(self, src: str, key: str) -> None:
        bulk = self._bulk()
        if bulk is None:
            self.fs.put_file(src, key)
        else:
            bulk.put_file(src, key.split("/", 1)[1])

    def _create(self, src: str, key: str) -> None:
        """Upload `src` only if no object is at `key`. On S3 a conditional PUT (If-None-Match: *, on
        the multipart upload's completion for a large file): of two writers, the later one is
        refused by the server. Other stores: look, then put, which two writers within one round
        trip can both pass; the manifest then lists the copy stored, checked against the ranks'."""
        if self.protocol in ("s3", "s3a"):
            try:
                self.fs.put_file(src, key, mode="create")
            except Exception as e:
                if not isinstance(e, FileExistsError) and not _precondition_failed(e):
                    raise
            return
        if not self.fs.exists(key):
            self.fs.put_file(src, key)

    def download_dir(self, path: str, local_dir: Path) -> dict[str, str]:
        """Files in parallel; a large file in ranges fetched in parallel into their places. On S3 every
        file comes as ranges read by object_store (`s3_bulk`) where obstore is installed; elsewhere
        (gs://, the rest) through fsspec. Each file is hashed as its ranges land (`RangeDigest`): the
        xxh3-128 digests are returned by path, so that the check against the manifest reads nothing again."""
        root = self._p(path)
        try:
            listing = self.fs.find(root, detail=True)
            reader = self._bulk()
        except FileNotFoundError:
            raise
        except Exception as e:
            raise StorageError(f"could not list {self.uri(path)}: {e}") from e
        if not listing:
            raise FileNotFoundError(f"{self.uri(path)} has no files")
        files = {name: name[len(root):].lstrip("/") for name, info in listing.items()
                 if info.get("type") != "directory"}
        for name, rel in files.items():
            # A key is whatever its writer chose: "ckpt/../../x" would land outside local_dir. Refused before a
            # byte is written.
            why = paths.relative_problem(rel)
            if why is not None:
                raise StorageError(f"{self.uri(path)} holds an object {name!r} that is not a file inside it ({why}); "
                                   f"nothing was downloaded to {local_dir}: remove that object from the bucket")
        jobs: list[futures.Future[Any]] = []
        digests: dict[str, RangeDigest] = {}
        for name, info in listing.items():
            if name not in files:
                continue
            target = Path(local_dir) / files[name]
            target.parent.mkdir(parents=True, exist_ok=True)
            size = int(info.get("size") or 0)
            with open(target, "wb") as f:
                f.truncate(size)
            if reader is not None:
                digest = digests[files[name]] = RangeDigest(target, size)
                key = name.split("/", 1)[1]
                for offset in range(0, size, s3_bulk.PART):
                    end = min(offset + s3_bulk.PART, size)
                    jobs.append(s3_bulk.pool().submit(_land, digest, offset, end, reader.read_into, key, target,
                                                        offset, end))
                continue
            if not size:
                # Fetched whole and not hashed here: a file system that lists no size shows 0 for any file.
                jobs.append(io_pool().submit(self._fetch, name, target, None, size))
                continue
            digest = digests[files[name]] = RangeDigest(target, size)
            for start in range(0, size, _RANGE) if size > 2 * _RANGE else [None]:
                end = size if start is None else min(start + _RANGE, size)
                jobs.append(io_pool().submit(_land, digest, start or 0, end, self._fetch, name, target, start, size))
        try:
            for job in jobs:
                job.result()
        except FileNotFoundError:
            raise
        except Exception as e:
            raise StorageError(f"could not download {self.uri(path)} to {local_dir}: {e}") from e
        finally:
            for job in jobs:
                job.cancel()  # a failed download stops here: the ranges not yet started are not fetched
            futures.wait(jobs)
        return {rel: hexdigest for rel, digest in digests.items() if (hexdigest := digest.hexdigest()) is not None}

    def _bulk(self) -> s3_bulk.BulkClient | None:
        """object_store's client of this bucket on S3 when obstore is installed (made once, from the fs's
        own client); None where fsspec moves the bytes."""
        if self.protocol not in ("s3", "s3a"):
            return None
        if self._bulk_client is None:
            try:
                import obstore  # noqa: F401
            except ImportError:
                return None
            self._bulk_client = s3_bulk.BulkClient.of(self.fs, self.root.split("/", 1)[0])
        return self._bulk_client

    def _fetch(self, name: str, target: Path, start: int | None, size: int) -> bytes | None:
        """The object `name` into `target`: whole (`start` None), or the range from `start`; the range's bytes,
        or None for a whole file, which lands without them."""
        if start is None:
            self.fs.get_file(name, str(target))
            return None
        data: bytes = self.fs.cat_file(name, start=start, end=min(start + _RANGE, size))
        fd = os.open(target, os.O_WRONLY)
        try:
            os.pwrite(fd, data, start)
        finally:
            os.close(fd)
        return data

    def write_atomic(self, path: str, data: bytes) -> None:
        # One PUT: an object store shows the old object or the new one, never a mix.
        try:
            self.fs.pipe_file(self._p(path), data)
        except Exception as e:
            raise _storage_error(f"could not write {self.uri(path)}", e) from e

    def read_bytes(self, path: str) -> bytes:
        try:
            data: bytes = self.fs.cat_file(self._p(path))
            return data
        except FileNotFoundError:
            raise
        except Exception as e:
            raise _storage_error(f"could not read {self.uri(path)}", e) from e

    def read_head(self, path: str, n: int) -> bytes:
        """At most the first `n` bytes of `path` (one ranged read): a reader that bounds what it takes."""
        try:
            head: bytes = self.fs.cat_file(self._p(path), start=0, end=n)
            return head
        except FileNotFoundError:
            raise
        except Exception as e:
            raise _storage_error(f"could not read {self.uri(path)}", e) from e

    def exists(self, path: str) -> bool:
        try:
            found: bool = self.fs.exists(self._p(path))
            return found
        except Exception as e:
            raise _storage_error(f"could not look for {self.uri(path)}", e) from e

    def size(self, path: str) -> int:
        try:
            return int(self.fs.size(self._p(path)))
        except FileNotFoundError:
            raise
        except Exception as e:
            raise _storage_error(f"could not look for {self.uri(path)}", e) from e

    def list_dirs(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(self._p(path), detail=True)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise _storage_error(f"could not list {self.uri(path)}", e) from e
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")

    def delete(self, path: str) -> None:
        try:
            self.fs.rm(self._p(path), recursive=True)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise _storage_error(f"could not delete {self.uri(path)}", e) from e

    def local_path(self, path: str) -> Path | None:
        return None  # files must be downloaded first

    def uri(self, path: str) -> str:
        return f"{self.url}/{path}" if path else self.url


def _land(digest: RangeDigest, start: int, end: int, fetch: Callable[..., Buffer | None], *args: object) -> None:
    """fetch(*args), which writes bytes [start, end) of the file, then those bytes into its digest."""
    digest.landed(start, end, fetch(*args))


def _storage_error(what: str, e: Exception) -> StorageError:
    """Every error of an object store's client (botocore's `EndpointConnectionError`, `NoCredentialsError`,
    aiohttp's, fsspec's own) as a `StorageError` saying what was done: retried with backoff
    (`outlast/storage/retry.py`), then reported as storage's. A refused permission stays one: waiting
    cannot mend it."""
    text = f"{what}: {type(e).__name__}: {e}"
    if isinstance(e, PermissionError):
        return StoragePermissionError(text)
    return StorageError(text)


class StoragePermissionError(StorageError, PermissionError):
    """Storage refused the call (AccessDenied): not retried."""
