"""A run's directory on storage: its run-state document and its checkpoints."""

from __future__ import annotations

import logging

import msgspec

from outlast.storage import records as r
from outlast.storage.base import Storage, StorageError
from outlast.storage.lease import Lease

LEASE_NAME = "driver_lease.json"

log = logging.getLogger("outlast.storage")


class RunStore:
    def __init__(self, storage: Storage, run_dir: str) -> None:
        self.storage = storage
        self.run_dir = run_dir

    def path(self, *parts: str) -> str:
        return "/".join((self.run_dir, *parts))

    def check_writable(self) -> None:
        """Raise `StorageError` saying what to change when the run's directory cannot be written."""
        probe = self.path(".outlast-write-check")
        try:
            self.storage.write_atomic(probe, b"")
            self.storage.delete(probe)
        except OSError as e:
            raise StorageError(
                f"cannot write the run's directory {self.storage.uri(self.run_dir)}: "
                f"{e.strerror or e}. RunConfig(storage_path=...) (or $OUTLAST_STORAGE_PATH) must name a "
                "directory you can write, or a URL your credentials can write"
            ) from e

    def load_state(self) -> r.RunState | None:
        try:
            data = self.storage.read_bytes(self.path(r.RUN_STATE_NAME))
        except FileNotFoundError:
            return None
        return r.decode(data, r.RunState, self.storage.uri(self.path(r.RUN_STATE_NAME)))

    def set_aside_state(self, now: float) -> str:
        """Move an unreadable run-state document out of the way, keeping it for inspection."""
        name = f"{r.RUN_STATE_NAME}.corrupt-{int(now)}"
        self.storage.write_atomic(self.path(name), self.storage.read_bytes(self.path(r.RUN_STATE_NAME)))
        self.storage.delete(self.path(r.RUN_STATE_NAME))
        return self.storage.uri(self.path(name))

    def save_state(self, state: r.RunState) -> None:
        self.storage.write_atomic(self.path(r.RUN_STATE_NAME), r.encode(state))

    def write_manifest(self, manifest: r.Manifest) -> None:
        self.storage.write_atomic(self.path(manifest.checkpoint_dir, r.MANIFEST_NAME), r.encode(manifest))

    def read_manifest(self, checkpoint_dir: str) -> r.Manifest | None:
        try:
            data = self.storage.read_bytes(self.path(checkpoint_dir, r.MANIFEST_NAME))
        except FileNotFoundError:
            return None
        return r.decode(data, r.Manifest, self.storage.uri(self.path(checkpoint_dir, r.MANIFEST_NAME)))

    def remove_uncommitted(self, committed: set[str]) -> list[str]:
        """Delete checkpoint directories that never got a manifest (a crash mid-upload).

        Call only while no worker of this run is alive: an upload in flight has no
        manifest yet either.
        """
        removed = []
        for name in self.storage.list_dirs(self.run_dir):
            if not r.is_checkpoint_dir_name(name) or name in committed:
                continue
            if self.storage.exists(self.path(name, r.MANIFEST_NAME)):
                continue
            self.storage.delete(self.path(name))
            removed.append(name)
        if removed:
            log.info("removed %d uncommitted checkpoint director%s: %s", len(removed),
                     "y" if len(removed) == 1 else "ies", ", ".join(removed))
        return removed

    def delete_checkpoint(self, checkpoint_dir: str) -> None:
        # The manifest goes first: a half-deleted directory must not look committed.
        self.storage.delete(self.path(checkpoint_dir, r.MANIFEST_NAME))
        self.storage.delete(self.path(checkpoint_dir))

    def read_lease(self) -> Lease | None:
        """The current lease; an unreadable one counts as none (a crash mid-write cannot lock a run)."""
        try:
            return msgspec.json.decode(self.storage.read_bytes(self.path(LEASE_NAME)), type=Lease)
        except FileNotFoundError:
            return None
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("ignoring an unreadable driver lease at %s", self.storage.uri(self.path(LEASE_NAME)))
            return None

    def write_lease(self, lease: Lease) -> None:
        self.storage.write_atomic(self.path(LEASE_NAME), msgspec.json.encode(lease))

    def delete_lease(self) -> None:
        self.storage.delete(self.path(LEASE_NAME))
