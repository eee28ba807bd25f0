"""The controller's storage effects carried out: the one module of the controller that calls storage.

`perform(effect, store, retry)` makes the calls, retried as `outlast/storage/retry.py` says, and
returns the event the core hears: `StorageDone` (or, for a manifest written and for what a read found,
its typed kind: `ManifestWritten`, `ManifestsRead`, `ChecksumsRead`, `UploadsFound`), or `StorageFailed`
with what storage said. Both executors (the driver's thread, the simulator's) call it.
"""

from __future__ import annotations

import logging
from typing import Callable

from outlast.controller import effects as fx
from outlast.faults import fault_point
from outlast.protocol.messages import FileEntry
from outlast.storage.checksum import ALGORITHM, hash_file, new_hasher
from outlast.storage.records import CorruptDocument, NewerVersionError
from outlast.storage.retry import Retrying
from outlast.storage.run_store import RunStore

log = logging.getLogger("outlast.controller")

Retry = Callable[[], Retrying]


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
        return fx.ManifestWritten(effect.id)
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
        return fx.ManifestsRead(effect.id, reads=tuple(_read_manifests(effect.candidates, store, retry)))
    if isinstance(effect, fx.ReadChecksums):
        return fx.ChecksumsRead(effect.id, checksums={
            path: _stored_checksum(store, effect.checkpoint_dir, path, algorithm, retry) for path, algorithm in effect.paths})
    if isinstance(effect, fx.CheckUploads):
        return _check_uploads(effect, store, retry)
    raise TypeError(f"not a storage effect: {effect!r}")


def _read_manifests(candidates: tuple[str, ...], store: RunStore, retry: Retry) -> list[fx.ManifestRead]:
    out = []
    for name in candidates:
        try:
            manifest = retry()(store.read_manifest, name)
        except CorruptDocument as e:
            out.append(fx.ManifestRead(name, skip=str(e)))
            continue
        except NewerVersionError as e:  # neither skipped nor restored: a newer outlast must go on from it
            out.append(fx.ManifestRead(name, newer=str(e)))
            return out
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


def _check_uploads(effect: fx.CheckUploads, store: RunStore, retry: Retry) -> fx.UploadsFound:
    """Every file of `effect` in storage at its size, or what is not. Each file is written whole (a
    rename, or one object), so one there at its size is the rank's; its checksum, of the stored bytes,
    is what the manifest gets and a restore compares with."""
    missing: list[str] = []
    for path, size in effect.files:
        try:
            stored = retry()(store.storage.size, store.path(effect.checkpoint_dir, path))
        except FileNotFoundError:
            missing.append(f"{path}: not in storage")
            continue
        except OSError as e:
            return fx.UploadsFound(effect.id, missing=(f"{path}: storage could not say ({e})",))
        if stored != size:
            missing.append(f"{path}: {stored} bytes in storage, {size} when the upload began")
    if missing:
        return fx.UploadsFound(effect.id, missing=tuple(missing))
    found = []
    for path, size in effect.files:
        checksum = _stored_checksum(store, effect.checkpoint_dir, path, ALGORITHM, retry)
        if checksum is None:
            return fx.UploadsFound(effect.id, missing=(f"{path}: could not be read back",))
        found.append(FileEntry(path=path, size=size, **{checksum[0]: checksum[1]}))
    return fx.UploadsFound(effect.id, files=tuple(found))
