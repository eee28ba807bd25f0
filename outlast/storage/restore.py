"""Make a committed checkpoint readable on this node: fetched once, checked against its manifest.

Every worker of a node may ask for the same checkpoint at the same moment; a file lock
makes the first one fetch and verify it and the others reuse the result.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

from outlast.storage.base import Storage
from outlast.storage.local import sha256_file
from outlast.storage.records import CorruptDocument, Manifest
from outlast.storage.run_store import RunStore

_KEEP_PER_RUN = 2


class CorruptCheckpointError(RuntimeError):
    """A committed checkpoint whose files are gone or differ from its manifest."""

    def __init__(self, checkpoint_dir: str, reason: str) -> None:
        super().__init__(f"checkpoint {checkpoint_dir} cannot be restored: {reason}")
        self.checkpoint_dir = checkpoint_dir
        self.reason = reason

    def __reduce__(self):
        return (type(self), (self.checkpoint_dir, self.reason))


def verify(root: Path, manifest: Manifest) -> None:
    for entry in manifest.files:
        path = root / entry.path
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(manifest.checkpoint_dir, f"file {entry.path} is missing") from None
        if size != entry.size:
            raise CorruptCheckpointError(manifest.checkpoint_dir,
                                         f"file {entry.path} has {size} bytes, the manifest says {entry.size}")
        if sha256_file(path) != entry.sha256:
            raise CorruptCheckpointError(manifest.checkpoint_dir, f"file {entry.path} does not match its checksum")


def materialize(storage: Storage, run_dir: str, name: str, cache_root: Path) -> Path:
    """A local directory with the verified files of checkpoint `name` of the run at `run_dir`."""
    store = RunStore(storage, run_dir)
    try:
        manifest = store.read_manifest(name)
    except CorruptDocument as e:
        raise CorruptCheckpointError(name, str(e)) from None
    if manifest is None:
        raise CorruptCheckpointError(name, f"its manifest is gone from {storage.uri(store.path(name))}")
    run_cache = cache_root / hashlib.sha1(storage.uri(run_dir).encode()).hexdigest()[:16]
    run_cache.mkdir(parents=True, exist_ok=True)
    local = storage.local_path(store.path(name))
    target = local if local is not None else run_cache / name
    marker = run_cache / f"{name}.verified"
    with open(run_cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return target
        if local is None:
            partial = run_cache / f".{name}.partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            try:
                storage.download_dir(store.path(name), partial)
            except FileNotFoundError:
                raise CorruptCheckpointError(name, "its files are gone from storage") from None
            shutil.rmtree(target, ignore_errors=True)
            os.replace(partial, target)
        verify(target, manifest)
        marker.touch()
    _evict(run_cache, keep=name)
    return target


def _evict(run_cache: Path, keep: str) -> None:
    """Keep the cache of a run small: this checkpoint and the most recent others."""
    markers = sorted(run_cache.glob("*.verified"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in markers[_KEEP_PER_RUN:]:
        name = old.name[: -len(".verified")]
        if name == keep:
            continue
        old.unlink(missing_ok=True)
        shutil.rmtree(run_cache / name, ignore_errors=True)
