"""Files opened under a root, never through a link out of it: every file a message names is opened here.

A message's path is checked when it is decoded (`outlast/protocol/paths.py`), but its text cannot say
where a link under the root leads: a rank's checkpoint directory may hold `model.pt -> /etc/shadow`, a
directory in it may be a link to `/`. So a path is walked one component at a time from a descriptor of
the root (openat), each directory opened with O_NOFOLLOW | O_DIRECTORY and the file with O_NOFOLLOW, and
the file must be a regular one (a FIFO or a device would block or never end a copy). A file written is
created anew (O_EXCL, after removing what was there), so that a link or a file planted where it goes is
replaced, never written through. The root itself is the caller's own (the tier's directory, a rank's
directory named in a checked message) and is opened as it is.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from outlast.protocol import paths
from outlast.storage.checksum import hash_file

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Read and write: a file received into is mapped (`tier_client.Landing`), which a write-only descriptor cannot be.
_WRITE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KEEP = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafePath(OSError):
    """A path that would leave its root (a '..', an absolute path, a link) or that names no regular file."""


def child(root: Path, *names: str) -> Path:
    """`root` joined with each of `names`, every one a single path component (a node id, a checkpoint's name)."""
    for name in names:
        why = paths.name_problem(name)
        if why is not None:
            raise UnsafePath(errno.EINVAL, f"{name!r} cannot be a name under {root}: {why}")
    return root.joinpath(*names)


def open_under(root: str | os.PathLike[str], rel: str, write: bool = False, owner: int | None = None,
               keep: bool = False) -> int:
    """A descriptor of the regular file `rel` under `root`, reached without following any link below `root`.
    `write`: the file is made anew (its directories too), for writing. `keep` (with `write`): a regular file
    of this process's user with no other link, found there, is opened to be written over instead (the
    tier's spare pages, placed in its own room for a copy); anything else is replaced as without it.
    `owner`: the file must belong to this uid (an agent running as root reads only what its workers' user
    wrote). Raises `UnsafePath` for a path or a file that is not allowed, OSError as the kernel says
    otherwise."""
    parent, name = _open_parent(root, rel, make=write)
    try:
        if write and keep:
            kept = _kept(parent, name)
            if kept is not None:
                return kept
        if write:
            try:
                os.unlink(name, dir_fd=parent)
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                raise UnsafePath(errno.EISDIR, f"{rel} under {root} is a directory") from None
        try:
            fd = os.open(name, _WRITE if write else _READ, 0o600, dir_fd=parent)
        except OSError as e:
            raise _refused(e, parent, name, root, rel) from None
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(errno.EINVAL, f"{rel} under {root} is not a regular file")
        if owner is not None and st.st_uid != owner:
            raise UnsafePath(errno.EPERM, f"{rel} under {root} belongs to uid {st.st_uid}, not to the workers' user "
                                          f"(uid {owner}): only a file the rank wrote is kept")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kept(parent: int, name: str) -> int | None:
    """`name` in `parent` opened for writing over, when it is a regular file of ours with no other link."""
    try:
        fd = os.open(name, _KEEP, dir_fd=parent)
    except OSError:  # absent, a link (ELOOP), a FIFO without a reader: made anew by the caller
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1:
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    return None


@contextmanager
def opened(root: str | os.PathLike[str], rel: str, write: bool = False,
           owner: int | None = None, keep: bool = False) -> Iterator[IO[bytes]]:
    """`open_under` as a binary file object, closed at the block's end."""
    with os.fdopen(open_under(root, rel, write, owner, keep), "wb" if write else "rb") as f:
        yield f


def size_under(root: str | os.PathLike[str], rel: str) -> int:
    fd = open_under(root, rel)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def hash_under(root: str | os.PathLike[str], rel: str, algorithm: str) -> tuple[int, str]:
    """(size, hex digest) of `rel` under `root` (`checksum.hash_file`)."""
    with opened(root, rel) as f:
        return hash_file(f, algorithm)


def copy_under(src_root: str | os.PathLike[str], rel: str, dst_root: str | os.PathLike[str],
               owner: int | None = None, keep: bool = False) -> None:
    """Copy `rel` from under `src_root` (a file of `owner`'s, when given) to the same place under `dst_root`,
    in the kernel. `keep`: as `open_under`'s, a file found there written over, cut to the copy's size."""
    with opened(src_root, rel, owner=owner) as fin, opened(dst_root, rel, write=True, keep=keep) as fout:
        offset, left = 0, os.fstat(fin.fileno()).st_size
        while left > 0:
            n = os.sendfile(fout.fileno(), fin.fileno(), offset, left)
            if n == 0:
                raise OSError(errno.EIO, f"{rel} under {src_root} ended before its size")
            offset, left = offset + n, left - n
        if keep and os.fstat(fout.fileno()).st_size != offset:
            os.ftruncate(fout.fileno(), offset)


def link_under(src_root: str | os.PathLike[str], rel: str, dst_root: str | os.PathLike[str],
               owner: int | None = None) -> None:
    """A hard link under `dst_root` of the very file opened under `src_root` (no link followed to reach it; a
    file of `owner`'s, when given). OSError as `link(2)` says: EXDEV across file systems, EPERM for another
    user's file with protected hard links."""
    src = open_under(src_root, rel, owner=owner)
    try:
        parent, name = _open_parent(dst_root, rel, make=True)
        try:
            try:
                os.unlink(name, dir_fd=parent)
            except FileNotFoundError:
                pass
            # The descriptor's own inode, through /proc: what a path would name may have changed since it was opened.
            os.link(f"/proc/self/fd/{src}", name, dst_dir_fd=parent, follow_symlinks=True)
        finally:
            os.close(parent)
    finally:
        os.close(src)


def open_parent(root: str | os.PathLike[str], rel: str) -> tuple[int, str]:
    """A descriptor of the directory `rel`'s file goes in under `root` (made, no link followed), and the file's
    name: the caller closes it."""
    return _open_parent(root, rel, make=True)


def _open_parent(root: str | os.PathLike[str], rel: str, make: bool) -> tuple[int, str]:
    """A descriptor of the directory `rel`'s file lies in (created when `make`), and the file's name."""
    why = paths.relative_problem(rel)
    if why is not None:
        raise UnsafePath(errno.EINVAL, f"{rel!r} is not a relative path inside {root}: {why}")
    *dirs, name = rel.split("/")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in dirs:
            if make:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except OSError as e:
                raise _refused(e, fd, part, root, rel) from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd, name


def _refused(e: OSError, dir_fd: int, name: str, root: str | os.PathLike[str], rel: str) -> OSError:
    """What to raise for `e`, met opening `name` in `dir_fd` on the way to `rel`."""
    if e.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW met a link, or O_DIRECTORY something else
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        if link:
            return UnsafePath(e.errno, f"{rel} under {root} goes through the link {name!r}, which is not followed: "
                                       "a checkpoint's files must lie in its directory, not behind a link")
    if e.errno == errno.ENXIO:  # a FIFO without a reader, a socket
        return UnsafePath(e.errno, f"{rel} under {root} is not a regular file")
    return e
