"""Storage on anything fsspec reaches: s3://, gs://, and the rest.

Credentials and endpoints come the usual way for each file system (for S3: the AWS
environment variables and config files, `AWS_ENDPOINT_URL` for S3-compatible servers).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

from outlast.faults import fault_point
from outlast.protocol.messages import FileEntry
from outlast.storage.base import StorageError

_CHUNK = 8 << 20


class RemoteStorage:
    def __init__(self, url: str) -> None:
        import fsspec

        protocol, _, rest = url.partition("://")
        if not rest.strip("/"):
            raise ValueError(f"storage_path {url!r} names no bucket or directory")
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as e:
            raise ValueError(f"storage_path {url!r}: no file system for '{protocol}://' ({e}); "
                             f"for s3:// run `pip install s3fs`, for gs:// `pip install gcsfs`") from None
        self.url = url.rstrip("/")
        self.protocol = protocol
        self.root = rest.strip("/")
        self._fs = None

    def __getstate__(self) -> dict:
        return {"url": self.url, "protocol": self.protocol, "root": self.root, "_fs": None}

    @property
    def fs(self):
        if self._fs is None:
            import fsspec

            # Listings must never come from a cache: other processes write the same run.
            self._fs = fsspec.filesystem(self.protocol, use_listings_cache=False, skip_instance_cache=True)
        return self._fs

    def _p(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def upload_dir(self, local_dir: Path, dest: str) -> list[FileEntry]:
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise StorageError(f"checkpoint directory {local_dir} does not exist or is not a directory")
        entries = []
        for dirpath, _dirs, files in os.walk(local_dir):
            for name in sorted(files):
                src = Path(dirpath) / name
                rel = src.relative_to(local_dir).as_posix()
                target = self._p(f"{dest}/{rel}")
                digest, size = hashlib.sha256(), 0
                try:
                    with open(src, "rb") as fin, self.fs.open(target, "wb") as fout:
                        while chunk := fin.read(_CHUNK):
                            digest.update(chunk)
                            fout.write(chunk)
                            size += len(chunk)
                except Exception as e:  # botocore and aiohttp raise their own types
                    raise StorageError(f"could not upload {src} to {self.uri(f'{dest}/{rel}')}: {e}") from e
                entries.append(FileEntry(path=rel, size=size, sha256=digest.hexdigest()))
                fault_point("upload.mid")
        return entries

    def download_dir(self, path: str, local_dir: Path) -> None:
        try:
            self.fs.get(self._p(path) + "/", str(local_dir) + "/", recursive=True)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise StorageError(f"could not download {self.uri(path)} to {local_dir}: {e}") from e

    def write_atomic(self, path: str, data: bytes) -> None:
        # One PUT: an object store shows the old object or the new one, never a mix.
        try:
            self.fs.pipe_file(self._p(path), data)
        except Exception as e:
            raise StorageError(f"could not write {self.uri(path)}: {e}") from e

    def read_bytes(self, path: str) -> bytes:
        try:
            return self.fs.cat_file(self._p(path))
        except FileNotFoundError:
            raise
        except Exception as e:
            raise StorageError(f"could not read {self.uri(path)}: {e}") from e

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._p(path))

    def list_dirs(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(self._p(path), detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._p(path), recursive=True)

    def local_path(self, path: str) -> Path | None:
        return None  # files must be downloaded first

    def uri(self, path: str) -> str:
        return f"{self.url}/{path}" if path else self.url
