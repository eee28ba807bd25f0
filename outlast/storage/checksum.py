"""File checksums: xxh3-128 for what outlast writes, sha256 for what older versions wrote.

xxh3 hashes at tens of GB/s on one core (sha256: about 1.3), so checking every byte of
a checkpoint costs less than reading it from the page cache. It is not a cryptographic
hash: it detects a corrupted or truncated file, not a forged one, which is what the
manifest asks of it (the storage's own access control keeps forgers out).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

import xxhash

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

ALGORITHM = "xxh3_128"
ALGORITHMS = ("xxh3_128", "sha256")
_CHUNK = 4 << 20


class Hasher(Protocol):
    """What `new_hasher` returns: hashlib's hashers and xxhash's alike."""

    def update(self, data: ReadableBuffer, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> Hasher:
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; this outlast knows {', '.join(ALGORITHMS)}")


def hash_file(path: str | os.PathLike[str] | IO[bytes], algorithm: str = ALGORITHM) -> tuple[int, str]:
    """(size, hex digest) of the file at `path`, or of a file already open (read from its start, left open)."""
    if not isinstance(path, (str, os.PathLike)):
        return _hash_open(path, algorithm)
    with open(path, "rb") as f:
        return _hash_open(f, algorithm)


def _hash_open(f: IO[bytes], algorithm: str) -> tuple[int, str]:
    digest = new_hasher(algorithm)
    size = os.fstat(f.fileno()).st_size
    if size and algorithm == "xxh3_128":
        # Hashed straight from the page cache: no copy into a buffer of ours.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            digest.update(view)
            return len(view), digest.hexdigest()
    size = 0
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


class InOrderDigests:
    """Checksums of files computed from their bytes as they are written, for the files whose chunks come in
    order (a transfer's do: one connection, sent in order), so that checking them reads nothing again.
    A file whose chunks come otherwise is left out of `digests()`: whoever checks it reads it."""

    def __init__(self, files: Mapping[str, tuple[str, int]]) -> None:
        """`files`: path -> (checksum algorithm, size)."""
        self._hashers = {path: new_hasher(algorithm) for path, (algorithm, _) in files.items()}
        self._sizes = {path: size for path, (_, size) in files.items()}
        self._next = dict.fromkeys(files, 0)  # the offset the next chunk must start at; -1: out of order

    def update(self, path: str, offset: int, data: memoryview | bytes) -> None:
        if path in self._next and self._next[path] == offset:
            self._hashers[path].update(data)
            self._next[path] = offset + len(data)
        elif path in self._next:
            self._next[path] = -1

    def digests(self) -> dict[str, str]:
        """path -> hex digest of each file hashed whole, in order."""
        return {path: h.hexdigest() for path, h in self._hashers.items() if self._next[path] == self._sizes[path]}


_WRITE_BEHIND = 16 << 20
_SYNC_FILE_RANGE_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start the writeback of dirty pages, do not wait for it


def _start_writeback() -> Callable[[int, int, int], object] | None:
    """sync_file_range(2) from the C library where there is one (Linux), else None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, n: call(fd, offset, n, _SYNC_FILE_RANGE_WRITE)


_writeback = _start_writeback()

# A copy that hashes what it copies moves 1 MiB at a time: the kernel copies the chunk, and the chunk is hashed
# from the page cache right after, while it is still in the CPU's cache. Measured here (512 MiB, fresh processes,
# load 5 to 11), it takes what the kernel's copy of the whole file and a hash of it after took, within the noise
# of a shared machine (one file: 0.22 s against 0.28 in one set of runs, 0.46 against 0.43 in another), with as
# much CPU or less. A copy through a buffer of ours (read, hash, write) was slower and erratic: ext4 takes a
# 1 MiB write(2) into large folios, which cost up to 2 s of CPU a copy when memory was in use elsewhere; the
# kernel's copy fills small ones.
COPY_CHUNK = 1 << 20


def copy_hashed(src: Path, dst: Path, write_behind: bool = False, algorithm: str = ALGORITHM) -> tuple[int, str]:
    """Copy `src` to `dst` (made, or cut to nothing) and return (size, hex digest) of the bytes copied, the
    same values as `hash_file(dst)` after it, taken in the pass that copies: the file is read once. The
    digest is of the bytes as they lie in `dst`, so a source changed during the copy gets the digest of
    the bytes copied, never of others.

    `write_behind`: as `copy_file`'s."""
    with open(src, "rb", buffering=0) as fin, open(dst, "w+b", buffering=0) as fout:
        return copy_hashed_open(fin.fileno(), fout.fileno(), write_behind, algorithm)


def copy_hashed_open(src: int, dst: int, write_behind: bool = False, algorithm: str = ALGORITHM) -> tuple[int, str]:
    """`copy_hashed` between two open files: `src` from its position (its start, as opened) into `dst`,
    empty and open for reading and writing. Each chunk is copied in the kernel (copy_file_range, a reflink
    where the file system shares extents; sendfile between two file systems), then read back from `dst`
    and hashed."""
    digest = new_hasher(algorithm)
    writeback = _writeback if write_behind else None
    buffer = memoryview(bytearray(COPY_CHUNK))
    kernel_copy = _copy_range
    copied = behind = 0  # bytes copied; of them, those whose writeback has been started
    while True:
        try:
            n = kernel_copy(src, dst)
        except OSError as e:
            if kernel_copy is _send or e.errno not in _NO_COPY_RANGE:
                raise
            kernel_copy = _send  # EXDEV, ENOSYS, EINVAL, EOPNOTSUPP: the two files lie apart; nothing was copied
            continue
        if n == 0:
            return copied, digest.hexdigest()
        read = 0
        while read < n:
            got = os.preadv(dst, [buffer[read:n]], copied + read)
            if got == 0:
                raise OSError(errno.EIO, f"a copy being hashed ended {copied + read} bytes in, before what was copied")
            read += got
        digest.update(buffer[:n])
        copied += n
        if writeback is not None and copied - behind >= _WRITE_BEHIND:
            writeback(dst, behind, copied - behind)
            behind = copied


_NO_COPY_RANGE = frozenset({errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP})


def _copy_range(src: int, dst: int) -> int:
    """At most a chunk from `src`'s position to `dst`'s, both moved past it."""
    return os.copy_file_range(src, dst, COPY_CHUNK)


def _send(src: int, dst: int) -> int:
    return os.sendfile(dst, src, None, COPY_CHUNK)


def copy_file(src: Path, dst: Path, write_behind: bool = False) -> None:
    """Copy in the kernel (copy_file_range): a reflink on file systems that share extents
    (XFS, Btrfs), a copy without user-space buffers elsewhere.

    `write_behind`: for a copy that is fsynced next, the disk's writeback of each 16 MiB starts
    as soon as it is copied (sync_file_range), so that the disk writes while the rest is copied
    and hashed instead of from the fsync on (about a sixth off a 512 MiB upload here)."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        left = os.fstat(fin.fileno()).st_size
        writeback = _writeback if write_behind else None
        step = _WRITE_BEHIND if writeback is not None else left
        offset = 0
        try:
            while left > 0:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), min(left, step))
                if n == 0:
                    break
                if writeback is not None:
                    writeback(fout.fileno(), offset, n)
                offset, left = offset + n, left - n
            return
        except OSError:
            pass  # EXDEV, ENOSYS, EINVAL on older kernels or odd file systems: plain copy below
    import shutil

    shutil.copyfile(src, dst)
