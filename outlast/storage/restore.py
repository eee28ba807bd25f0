"""Make a committed checkpoint readable on this node, checked against its manifest at every restore.

Every worker of a node may ask for the same checkpoint at the same moment; a file lock
makes the first one fetch it from a remote store and the others reuse the download.
Nothing is trusted across restores: each one compares every file's size and checksum
with the manifest (files in parallel, xxh3 at the speed of the page cache), because a
file can rot, be truncated or be overwritten between two restores on either side. A
file just downloaded is checked with the digest taken of its ranges as they landed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Mapping
from concurrent import futures
from pathlib import Path

from outlast.protocol.messages import FileEntry
from outlast.storage.base import Storage
from outlast.storage.checksum import ALGORITHM, hash_file
from outlast.storage.priority import io_pool
from outlast.storage.records import CorruptDocument, Manifest
from outlast.storage.run_store import RunStore

_KEEP_PER_RUN = 2
_COMPLETE = ".complete"  # a download that finished; says nothing about its bytes, which are checked anyway


class CorruptCheckpointError(RuntimeError):
    """A committed checkpoint whose files are gone or differ from its manifest."""

    def __init__(self, checkpoint_dir: str, reason: str) -> None:
        super().__init__(f"checkpoint {checkpoint_dir} cannot be restored: {reason}")
        self.checkpoint_dir = checkpoint_dir
        self.reason = reason

    def __reduce__(self) -> tuple[type[CorruptCheckpointError], tuple[str, str]]:
        return (type(self), (self.checkpoint_dir, self.reason))


def _check_one(root: Path, entry: FileEntry, known: str | None) -> str | None:
    """Why the file of `entry` under `root` does not match it; None when it does. `known`: the file's xxh3-128,
    taken as it was written, compared in place of reading it again."""
    path = root / entry.path
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"file {entry.path} is missing"
    if size != entry.size:
        return f"file {entry.path} has {size} bytes, the manifest says {entry.size}"
    algorithm, expected = entry.checksum
    digest = known if known is not None and algorithm == ALGORITHM else hash_file(path, algorithm)[1]
    if digest != expected:
        return f"file {entry.path} does not match its checksum ({algorithm})"
    return None


def verify(root: Path, manifest: Manifest, known: Mapping[str, str] | None = None) -> None:
    """Raise CorruptCheckpointError naming the first file (in manifest order) that differs. `known`: xxh3-128
    digests by path of files just written under `root`, taken from their bytes as they landed
    (`Storage.download_dir` returns them); the others are read and hashed here."""
    known = known or {}
    jobs = [io_pool().submit(_check_one, root, entry, known.get(entry.path)) for entry in manifest.files]
    try:
        for job in jobs:
            reason = job.result()
            if reason is not None:
                raise CorruptCheckpointError(manifest.checkpoint_dir, reason)
    finally:
        for job in jobs:
            job.cancel()
        futures.wait(jobs)


def materialize(storage: Storage, run_dir: str, name: str, cache_root: Path) -> Path:
    """A local directory with the verified files of checkpoint `name` of the run at `run_dir`."""
    store = RunStore(storage, run_dir)
    try:
        manifest = store.read_manifest(name)
    except CorruptDocument as e:
        raise CorruptCheckpointError(name, str(e)) from None
    if manifest is None:
        raise CorruptCheckpointError(name, f"its manifest is gone from {storage.uri(store.path(name))}")
    local = storage.local_path(store.path(name))
    if local is not None:
        # Storage is a file system: the committed directory is read where it lies.
        verify(local, manifest)
        return local
    run_cache = cache_root / hashlib.sha1(storage.uri(run_dir).encode()).hexdigest()[:16]
    run_cache.mkdir(parents=True, exist_ok=True)
    target = run_cache / name
    complete = run_cache / f"{name}{_COMPLETE}"
    with open(run_cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete.exists():
            try:
                verify(target, manifest)
                complete.touch()  # recently used: evicted last
                return target
            except CorruptCheckpointError:
                complete.unlink(missing_ok=True)  # the copy here rotted: fetch it again
        partial = run_cache / f".{name}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            digests = storage.download_dir(store.path(name), partial)
        except FileNotFoundError:
            raise CorruptCheckpointError(name, "its files are gone from storage") from None
        try:
            verify(partial, manifest, digests)
        except CorruptCheckpointError:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)
        complete.touch()
    _evict(run_cache, keep=name)
    return target


def _evict(run_cache: Path, keep: str) -> None:
    """Keep the cache of a run small: this checkpoint and the most recent others."""
    markers = sorted(run_cache.glob(f"*{_COMPLETE}"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in markers[_KEEP_PER_RUN:]:
        name = old.name[: -len(_COMPLETE)]
        if name == keep:
            continue
        old.unlink(missing_ok=True)
        shutil.rmtree(run_cache / name, ignore_errors=True)
