"""Storage on a local or network file system."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from outlast.faults import fault_point
from outlast.protocol.messages import FileEntry
from outlast.storage.base import StorageError

_CHUNK = 4 << 20
_pool: ThreadPoolExecutor | None = None


def _copy_pool() -> ThreadPoolExecutor:
    # Created on first use, never at import: a process that forks workers must have no threads.
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(4, 2 * (os.cpu_count() or 1)), thread_name_prefix="outlast-copy")
    return _pool


def sized_sha256(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)  # releases the GIL: hashing runs beside the copies
            size += len(chunk)
    return size, digest.hexdigest()


def copy_durably(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree_dirs(top: Path, dirs: set[Path]) -> None:
    """fsync `dirs` and every directory between them and `top`, and `top`'s parent (which holds it)."""
    todo = {top, top.parent}
    for d in dirs:
        while d != top and top in d.parents:
            todo.add(d)
            d = d.parent
    for d in sorted(todo, key=lambda p: len(p.parts), reverse=True):  # deepest first
        fsync_dir(d)


def sha256_file(path: Path) -> str:
    return sized_sha256(path)[1]


class LocalStorage:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()

    def _p(self, path: str) -> Path:
        return self.root / path if path else self.root

    def upload_dir(self, local_dir: Path, dest: str) -> list[FileEntry]:
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise StorageError(f"checkpoint directory {local_dir} does not exist or is not a directory")
        target = self._p(dest)
        # Each file is copied by the kernel (copy_file_range) while another thread hashes the
        # source, and files go in parallel: the upload runs at the speed of hashing on every
        # core, not of one read-hash-write loop. A file that changes meanwhile ends up with a
        # checksum that does not match it, which a restore detects.
        pool = _copy_pool()
        jobs = []
        try:
            for dirpath, _dirnames, filenames in os.walk(local_dir):
                rel_dir = Path(dirpath).relative_to(local_dir)
                (target / rel_dir).mkdir(parents=True, exist_ok=True)
                for name in sorted(filenames):
                    src, rel = Path(dirpath) / name, (rel_dir / name).as_posix()
                    jobs.append((rel, pool.submit(copy_durably, src, target / rel), pool.submit(sized_sha256, src)))
        except OSError as e:
            raise StorageError(f"could not copy checkpoint files from {local_dir} to {target}: {e}") from e
        entries: list[FileEntry] = []
        try:
            for rel, copy, digest in jobs:
                copy.result()
                size, sha = digest.result()
                entries.append(FileEntry(path=rel, size=size, sha256=sha))
                fault_point("upload.mid")  # other files may still be on their way: a crash mid-upload
        except OSError as e:
            raise StorageError(f"could not copy checkpoint files from {local_dir} to {target}: {e}") from e
        finally:
            # Never return while a copy still writes into the checkpoint directory.
            futures.wait([f for _, copy, digest in jobs for f in (copy, digest)])
        try:
            # The manifest, written next, must never name a file a power loss could take back.
            fsync_tree_dirs(target, {(target / rel).parent for rel, _, _ in jobs})
        except OSError as e:
            raise StorageError(f"could not make the checkpoint files in {target} durable: {e}") from e
        return entries

    def write_atomic(self, path: str, data: bytes) -> None:
        target = self._p(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
            fsync_dir(target.parent)  # the rename itself must survive a power loss
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read_bytes(self, path: str) -> bytes:
        return self._p(path).read_bytes()

    def exists(self, path: str) -> bool:
        return self._p(path).exists()

    def list_dirs(self, path: str) -> list[str]:
        base = self._p(path)
        if not base.is_dir():
            return []
        return sorted(p.name for p in base.iterdir() if p.is_dir())

    def delete(self, path: str) -> None:
        target = self._p(path)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()

    def download_dir(self, path: str, local_dir: Path) -> None:
        shutil.copytree(self._p(path), local_dir, dirs_exist_ok=True)

    def local_path(self, path: str) -> Path | None:
        return self._p(path)

    def uri(self, path: str) -> str:
        return str(self._p(path))

