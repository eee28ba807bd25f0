"""Reading a file named by a document (a run's history, a storage listing) without letting the
document choose what is read: the path is relative and inside a root, no link on the way is
followed, and what is opened is a regular file whose size is checked before it is read.

Who can write the storage path or a node's log directory (a shared bucket, a run's own workers)
can put a link there, or a name with `..` in a history: either would make a reader that follows
it open a file of the machine's instead (docs/dashboard.md, "Security").
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

READ_BLOCK = 1 << 20


class Refused(Exception):
    """A file that is not read: the message says which and why."""


def relative_parts(rel: str) -> list[str]:
    """`rel` as its '/'-separated parts, each a plain name: no absolute path, no `.`, `..` or empty part."""
    parts = rel.split("/")
    if not rel or "\x00" in rel or any(p in ("", ".", "..") for p in parts):
        raise Refused(f"{rel!r} is not a relative path of plain names inside its directory")
    return parts


def open_under(root: Path, rel: str) -> int:
    """A descriptor of the regular file `root/rel`, opened one part at a time without following a
    link (a link anywhere under `root` is refused, even one that points back inside: outlast
    makes none). FileNotFoundError when it is not there; `Refused` for anything else it is."""
    parts = relative_parts(rel)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            # O_NONBLOCK: a FIFO put in the file's place opens at once (and is refused below) rather than hang.
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ENAMETOOLONG:
                    raise Refused(f"a name in {rel[:300]!r} is longer than this file system allows") from None
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    where = "/".join(parts[:i + 1])
                    raise Refused(f"{root / where} is a symbolic link or not a directory; links are not "
                                  "followed here") from None
                raise
            os.close(fd)
            fd = nxt
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Refused(f"{root / rel} is not a regular file")
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_at_most(fd: int, limit: int) -> bytes:
    """Up to `limit + 1` bytes from the start: one byte past the limit says the file grew past it."""
    chunks, got = [], 0
    while got <= limit:
        chunk = os.pread(fd, min(READ_BLOCK, limit + 1 - got), got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def tail_lines(fd: int, n: int, max_bytes: int) -> tuple[list[str], bool]:
    """The last `n` lines of the file, read backwards from its end, never more than `max_bytes` of it.

    Returns the lines and whether the byte bound cut them short (fewer than `n`, the first one
    perhaps a part of its line)."""
    pos = os.fstat(fd).st_size
    start = max(0, pos - max_bytes)
    data = b""
    while pos > start and data.count(b"\n") <= n:
        step = min(READ_BLOCK, pos - start)
        pos -= step
        data = os.pread(fd, step, pos) + data
    lines = data.decode("utf-8", "replace").splitlines()
    cut = start > 0 and pos == start and data.count(b"\n") <= n
    return (lines[-n:] if n > 0 else []), cut
