"""Storage on a local or network file system."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from concurrent import futures
from pathlib import Path

from outlast.faults import fault_point
from outlast.protocol.messages import FileEntry
from outlast.storage.base import StorageError
from outlast.storage import priority
from outlast.storage.checksum import ALGORITHM, copy_file, copy_hashed, copy_hashed_open, hash_file
from outlast.storage.priority import io_pool
from outlast.trace import mark


def walk_files(local_dir: Path) -> tuple[list[str], list[str]]:
    """('/'-separated relative paths of every file, of every directory) under `local_dir`."""
    files: list[str] = []
    dirs: list[str] = []
    for dirpath, dirnames, filenames in os.walk(local_dir):
        rel_dir = Path(dirpath).relative_to(local_dir)
        dirs.extend((rel_dir / d).as_posix() for d in dirnames)
        files.extend((rel_dir / name).as_posix() for name in sorted(filenames))
    return files, dirs


def _place(src: Path, dst: Path, move: bool, replace: bool) -> tuple[int, str] | None:
    """Put `src`'s bytes at `dst` whole, through a temporary name beside it, and return (size, xxh3) of
    what was placed; None when `replace` is off and `dst` already exists (it is left as it is).

    `replace` renames over `dst` atomically. Without it `dst` is created only if absent: a hard
    link from the temporary name fails with EEXIST when another writer got there first, so of
    ranks racing on one file, a rank that does not replace never overwrites one that does."""
    if not replace and os.path.lexists(dst):
        return None  # the common case of a file another rank wrote: no bytes copied for nothing
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}.tmp")
    try:
        linked = False
        if move:
            # A hard link, not a rename: the source stays whole until the caller deletes it, so
            # a retried upload finds every file again. No bytes move at all.
            with contextlib.suppress(OSError):  # another file system (EXDEV), or no hard links
                os.link(src, tmp)
                linked = True
        # A copy is hashed in the pass that makes it (and fsynced before the manifest).
        sized = hash_file(tmp, ALGORITHM) if linked else copy_hashed(src, tmp, write_behind=True)
        if replace:
            os.replace(tmp, dst)
            return sized
        try:
            os.link(tmp, dst)
        except FileExistsError:
            return None
        except OSError:
            return _create_exclusive(src, dst)  # a file system without hard links
        return sized
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _create_exclusive(src: Path, dst: Path) -> tuple[int, str] | None:
    try:
        with open(dst, "xb+", buffering=0) as out, open(src, "rb", buffering=0) as source:  # O_EXCL: only if absent
            return copy_hashed_open(source.fileno(), out.fileno())
    except FileExistsError:
        return None


def _place_and_hash(src: Path, dst: Path, move: bool, replace: bool) -> tuple[int, str]:
    """(size, xxh3) of this copy: the stored file's when placed, the source's when another's was kept."""
    sized = _place(src, dst, move, replace)
    if sized is None:
        return hash_file(src, ALGORITHM)
    mark("upload.placed", file=dst.name)
    fsync_file(dst)
    mark("upload.fsynced", file=dst.name)
    return sized


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
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


def dirs_to_fsync(top: Path, holding: set[Path]) -> tuple[list[Path], list[Path]]:
    """The directories an upload into `top` makes durable: (those above the files, whose entries are all made
    before the first file is copied: every directory between `holding` and `top`, `top` and its parent;
    `holding`, the directories the files go into, whose entries are complete once the last file is placed),
    deepest first."""
    above = {top, top.parent}
    for d in holding:
        while d != top and top in d.parents:
            above.add(d.parent)
            d = d.parent
    return _deepest_first(above - holding), _deepest_first(holding)


def _deepest_first(dirs: set[Path]) -> list[Path]:
    return sorted(dirs, key=lambda p: (-len(p.parts), str(p)))


class LocalStorage:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()

    def _p(self, path: str) -> Path:
        return self.root / path if path else self.root

    def upload_dir(self, local_dir: Path, dest: str, move: bool = False, replace: bool = True) -> list[FileEntry]:
        """Copy (or with `move`, link where the file system allows) every file under
        `local_dir` into `dest/`, files in parallel, each with its size and xxh3-128.
        `replace=False`: a file already in `dest/` is kept (see `Storage.upload_dir`).

        The checksum is taken in the pass that copies the file (`checksum.copy_hashed`), of the
        bytes written to storage: what a restore will compare with, even for a source changed
        during the copy. A linked file (`move`) is hashed as it lies in storage.
        """
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise StorageError(f"checkpoint directory {local_dir} does not exist or is not a directory")
        target = self._p(dest)
        jobs = []
        try:
            files, dirs = walk_files(local_dir)
            target.mkdir(parents=True, exist_ok=True)
            for rel in dirs:
                (target / rel).mkdir(parents=True, exist_ok=True)
            for rel in files:
                jobs.append((rel, priority.submit(_place_and_hash, local_dir / rel, target / rel, move, replace)))
        except OSError as e:
            futures.wait([job for _, job in jobs])
            raise StorageError(f"could not copy checkpoint files from {local_dir} to {target}: {e}") from e
        # Each file is fsynced by its own job, once placed. The manifest, written next, must never name a file a
        # power loss could take back: the directories' entries are made durable too, those above the files' now,
        # beside the copies, and those the files go into once the last is placed.
        above, holding = dirs_to_fsync(target, {(target / rel).parent for rel in files})
        entries: list[FileEntry] = []
        try:
            try:
                for d in above:
                    fsync_dir(d)
            except OSError as e:
                raise StorageError(f"could not make the checkpoint directory {target} durable: {e}") from e
            for rel, job in jobs:
                size, digest = job.result()
                entries.append(FileEntry(path=rel, size=size, xxh3_128=digest))
                fault_point("upload.mid")  # other files may still be on their way: a crash mid-upload
        except StorageError:
            raise
        except OSError as e:
            raise StorageError(f"could not copy checkpoint files from {local_dir} to {target}: {e}") from e
        finally:
            # Never return while a copy still writes into the checkpoint directory.
            futures.wait([job for _, job in jobs])
        try:
            if len(holding) > 1:
                for done in [io_pool().submit(fsync_dir, d) for d in holding]:
                    done.result()
            else:
                for d in holding:
                    fsync_dir(d)
        except OSError as e:
            raise StorageError(f"could not make the checkpoint files in {target} durable: {e}") from e
        mark("upload.dirs_fsynced", dirs=len(above) + len(holding))
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

    def read_head(self, path: str, n: int) -> bytes:
        with self._p(path).open("rb") as f:
            return f.read(n)

    def exists(self, path: str) -> bool:
        return self._p(path).exists()

    def size(self, path: str) -> int:
        """Raise FileNotFoundError when `path` is not a file."""
        return self._p(path).stat().st_size

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

    def download_dir(self, path: str, local_dir: Path) -> dict[str, str]:
        """Copied in the kernel, hashed by none: no digest is returned."""
        source = self._p(path)
        if not source.is_dir():
            raise FileNotFoundError(f"{source} does not exist")
        files, dirs = walk_files(source)
        for rel in ["", *dirs]:
            (Path(local_dir) / rel).mkdir(parents=True, exist_ok=True)
        jobs = [io_pool().submit(copy_file, source / rel, Path(local_dir) / rel) for rel in files]
        try:
            for job in jobs:
                job.result()
        finally:
            futures.wait(jobs)
        return {}

    def local_path(self, path: str) -> Path | None:
        return self._p(path)

    def uri(self, path: str) -> str:
        return str(self._p(path))

