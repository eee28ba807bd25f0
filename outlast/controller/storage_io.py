"""The controller's storage effects carried out: the one module of the controller that calls storage.

`perform(effect, store, retry)` makes the calls, retried as `outlast/storage/retry.py` says, and
returns the event the core hears: `StorageDone` with what was found, or `StorageFailed` with what
storage said. Both executors (the driver's thread, the simulator's) call it.
"""

from __future__ import annotations

import logging
from typing import Callable

import tenacity

from outlast.controller import effects as fx
from outlast.faults import fault_point
from outlast.storage.checksum import hash_file, new_hasher
from outlast.storage.records import CorruptDocument, NewerVersionError
from outlast.storage.run_store import RunStore

log = logging.getLogger("outlast.controller")

Retry = Callable[[], tenacity.Retrying]


def perform(effect: fx.StorageEffect, store: RunStore, retry: Retry) -> fx.StorageEvent:
    what = fx.describe(effect)
    try:
        return _perform(effect, store, retry)
    except (OSError, ValueError, NewerVersionError) as e:  # after the retries: what storage said last
        return fx.StorageFailed(effect.id, what, str(e) or type(e).__name__)


def _perform(effect: fx.StorageEffect, store: RunStore, retry: Retry) -> fx.StorageEvent:
    if isinstance(effect, fx.WriteRunState):
        retry()(store.save_state_encoded, effect.data)
        if effect.names_commit:
            fault_point("commit.after_run_state")
        return fx.StorageDone(effect.id)
    if isinstance(effect, fx.WriteManifest):
        fault_point("commit.before_manifest")
        retry()(store.write_manifest, effect.manifest)
        fault_point("commit.after_manifest")
        return fx.StorageDone(effect.id)
    if isinstance(effect, fx.DeleteCheckpoint):
        try:
            retry()(store.delete_checkpoint, effect.checkpoint_dir)
        except PermissionError as e:
            return fx.StorageDone(effect.id, warning=str(e))
        return fx.StorageDone(effect.id)
    if isinstance(effect, fx.RemoveUncommitted):
        try:
            retry()(store.remove_uncommitted, set(effect.keep), effect.from_attempt)
        except OSError as e:  # garbage left for the next time; nothing is lost
            return fx.StorageDone(effect.id, warning=f"could not remove uncommitted checkpoint directories: {e}")
        return fx.StorageDone(effect.id)
    if isinstance(effect, fx.ReadManifests):
        return fx.StorageDone(effect.id, _read_manifests(effect.candidates, store, retry))
    if isinstance(effect, fx.ReadChecksums):
        return fx.StorageDone(effect.id, {path: _stored_checksum(store, effect.checkpoint_dir, path, algorithm, retry)
                                          for path, algorithm in effect.paths})
    if isinstance(effect, fx.CheckUploads):
        return fx.StorageDone(effect.id, _missing_files(effect, store, retry))
    raise TypeError(f"not a storage effect: {effect!r}")


def _read_manifests(candidates: tuple[str, ...], store: RunStore, retry: Retry) -> list[fx.ManifestRead]:
    out = []
    for name in candidates:
        try:
            manifest = retry()(store.read_manifest, name)
        except CorruptDocument as e:
            out.append(fx.ManifestRead(name, skip=str(e)))
            continue
        except OSError as e:
            out.append(fx.ManifestRead(name, unreadable=str(e)))
            return out
        if manifest is None:
            out.append(fx.ManifestRead(name, skip="its manifest is gone from storage"))
            continue
        out.append(fx.ManifestRead(name, ranks=tuple(manifest.ranks)))
        return out
    return out


def _stored_checksum(store: RunStore, checkpoint_dir: str, path: str, algorithm: str,
                     retry: Retry) -> tuple[str, str] | None:
    storage, full = store.storage, store.path(checkpoint_dir, path)
    try:
        local = storage.local_path(full)
        if local is not None and local.exists():
            return algorithm, hash_file(local, algorithm)[1]
        digest = new_hasher(algorithm)
        digest.update(retry()(storage.read_bytes, full))
    except OSError:
        return None
    return algorithm, digest.hexdigest()


def _missing_files(effect: fx.CheckUploads, store: RunStore, retry: Retry) -> list[str]:
    """The files of `effect` that storage lacks or holds at another size (sizes alone: the bytes
    were checked by the rank that uploaded them, and a restore checks them again)."""
    missing = []
    for path, size in effect.files:
        try:
            stored = retry()(store.storage.size, store.path(effect.checkpoint_dir, path))
        except FileNotFoundError:
            stored = None
        except OSError:
            return [path for path, _ in effect.files]  # cannot tell: as good as missing
        if stored != size:
            missing.append(path)
    return missing
