"""A run's directory on storage: its run-state document and its checkpoints."""

from __future__ import annotations

import logging

import msgspec

from outlast.storage import naming, records as r
from outlast.storage.base import Storage, StorageError, StorageFenced
from outlast.storage.conditional import ConditionalStore, conditional
from outlast.storage.lease import LEASE_VERSION, Lease

LEASE_NAME = r.LEASE_NAME

log = logging.getLogger("outlast.storage")


def read_document(storage: Storage, path: str, limit: int | None = None) -> bytes:
    """A document from storage, read no further than `limit` bytes (records.MAX_DOCUMENT_BYTES):
    `DocumentTooLarge` past it."""
    limit = r.MAX_DOCUMENT_BYTES if limit is None else limit
    data = storage.read_head(path, limit + 1)
    if len(data) > limit:
        raise r.DocumentTooLarge(storage.uri(path), limit)
    return data


class RunStore:
    def __init__(self, storage: Storage, run_dir: str) -> None:
        self.storage = storage
        self.run_dir = run_dir
        self.fenced: str | None = None  # why this driver may no longer write the run
        self._cas: ConditionalStore | None = None

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

    def _read_document(self, path: str, limit: int | None = None) -> bytes:
        return read_document(self.storage, path, limit)

    def load_state(self) -> r.RunState | None:
        try:
            data = self._read_document(self.path(r.RUN_STATE_NAME))
        except FileNotFoundError:
            return None
        return r.decode(data, r.RunState, self.storage.uri(self.path(r.RUN_STATE_NAME)))

    def set_aside_state(self, now: float) -> str:
        """Move an unreadable run-state document out of the way, keeping it for inspection."""
        if not self._may_write("the unreadable run state aside"):
            return ""
        name = f"{r.RUN_STATE_NAME}.corrupt-{int(now)}"
        self.storage.write_atomic(self.path(name), self._read_document(self.path(r.RUN_STATE_NAME)))
        self.storage.delete(self.path(r.RUN_STATE_NAME))
        return self.storage.uri(self.path(name))

    def save_state(self, state: r.RunState) -> None:
        if not self._may_write("the run state"):
            return
        self.storage.write_atomic(self.path(r.RUN_STATE_NAME), r.encode(state))

    def save_state_encoded(self, data: bytes) -> None:
        """`save_state` of a run state encoded earlier (`records.encode`): the controller's snapshot."""
        if not self._may_write("the run state"):
            return
        self.storage.write_atomic(self.path(r.RUN_STATE_NAME), data)

    def write_manifest(self, manifest: r.Manifest) -> None:
        if not self._may_write(f"the manifest of {manifest.checkpoint_dir}"):
            raise StorageFenced(f"not committing {manifest.checkpoint_dir}: {self.fenced}")
        self.storage.write_atomic(self.path(manifest.checkpoint_dir, r.MANIFEST_NAME), r.encode(manifest))

    def _checkpoint_problem(self, checkpoint_dir: object) -> str | None:
        """Why `checkpoint_dir` (read from a document: a run state, a report) names no checkpoint directory of this
        run, or None: one directory name, inside the run's directory, never a path to follow out of it."""
        if isinstance(checkpoint_dir, str) and naming.is_default_name(checkpoint_dir):
            return None
        problem = naming.name_problem(checkpoint_dir)
        return None if problem is None or problem.startswith("the run directory") else problem

    def read_manifest(self, checkpoint_dir: str) -> r.Manifest | None:
        """The manifest of a checkpoint of this run; `CorruptDocument` when it cannot be read, or when
        `checkpoint_dir` is not the name of a checkpoint directory (then nothing is opened)."""
        if (problem := self._checkpoint_problem(checkpoint_dir)) is not None:
            raise r.CorruptDocument(f"{checkpoint_dir!r} in {self.storage.uri(self.run_dir)} is not the name of a "
                                    f"checkpoint directory ({problem}): nothing was read there")
        try:
            data = self._read_document(self.path(checkpoint_dir, r.MANIFEST_NAME))
        except FileNotFoundError:
            return None
        return r.decode(data, r.Manifest, self.storage.uri(self.path(checkpoint_dir, r.MANIFEST_NAME)))

    def checkpoint_dirs(self) -> dict[str, int | None]:
        """The run's checkpoint directories, committed or not, and the attempt that wrote each (None: its marker
        cannot be read): outlast's own names, and named ones by their marker. Anything else under the run's
        directory is the user's, and left alone."""
        found: dict[str, int | None] = {}
        for name in self.storage.list_dirs(self.run_dir):
            if naming.is_default_name(name):
                found[name] = int(name.split("_")[1])
                continue
            try:
                marker = naming.decode_marker(self._read_document(self.path(name, naming.MARKER_NAME),
                                                                  r.MAX_SMALL_DOCUMENT_BYTES))
            except FileNotFoundError:
                continue
            except r.DocumentTooLarge:
                marker = None  # unreadable, as a marker cut short is: it still marks a checkpoint's directory
            found[name] = marker.attempt if marker is not None else None
        return found

    def remove_uncommitted(self, committed: set[str], from_attempt: int | None = None) -> list[str]:
        """Delete checkpoint directories that never got a manifest (a crash mid-upload), except those of
        attempts numbered `from_attempt` or higher.

        Only while no worker of an attempt below `from_attempt` is alive: an upload in flight has no
        manifest yet either.
        """
        removed: list[str] = []
        if not self._may_write("(removing) uncommitted checkpoints"):
            return removed
        for name, attempt in self.checkpoint_dirs().items():
            if name in committed:
                continue
            if from_attempt is not None and attempt is not None and attempt >= from_attempt:
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
        if not self._may_write(f"(deleting) {checkpoint_dir}"):
            return
        if (problem := self._checkpoint_problem(checkpoint_dir)) is not None:
            log.warning("not deleting %r in %s: it is not the name of a checkpoint directory (%s)", checkpoint_dir,
                        self.storage.uri(self.run_dir), problem)
            return
        self.storage.delete(self.path(checkpoint_dir, r.MANIFEST_NAME))
        self.storage.delete(self.path(checkpoint_dir))

    def write_reports(self, segment: r.ReportSegment) -> None:
        if not self._may_write(f"the reports of attempt {segment.attempt}"):
            return
        self.storage.write_atomic(self.path(r.report_segment_name(segment.attempt, segment.first_index)),
                                  r.encode_compact(segment))

    def read_reports(self, attempt: int) -> list[r.ReportEntry]:
        """Rank 0's reports of one attempt, oldest first (none when the driver kept none)."""
        out: list[r.ReportEntry] = []
        for first in range(0, 1 << 40, r.REPORTS_PER_SEGMENT):
            where = self.path(r.report_segment_name(attempt, first))
            try:
                data = self._read_document(where)
            except FileNotFoundError:
                return out
            segment = r.decode(data, r.ReportSegment, self.storage.uri(where))
            out += segment.reports
            if len(segment.reports) < r.REPORTS_PER_SEGMENT:
                break
        return out

    def read_lease(self) -> tuple[Lease | None, str | None]:
        """The current lease and its version on storage (for `write_lease_if`). An unreadable lease
        counts as none (a crash mid-write cannot lock a run), but keeps its version. A lease of a newer
        version raises `NewerVersionError`: who holds it, and whether it lives, may be said otherwise there."""
        current = self._conditional().read_versioned(self.path(LEASE_NAME))
        if current is None:
            return None, None
        if not current.whole:
            log.warning("ignoring a driver lease at %s larger than any lease (%d bytes): it was not read",
                        self.storage.uri(self.path(LEASE_NAME)), r.MAX_SMALL_DOCUMENT_BYTES)
            return None, current.version
        try:  # the version first: a newer lease may not decode as this one's
            version = msgspec.json.decode(current.data, type=r.DocumentVersion).version
        except (msgspec.DecodeError, msgspec.ValidationError):
            version = LEASE_VERSION
        if version > LEASE_VERSION:
            raise r.NewerVersionError(self.storage.uri(self.path(LEASE_NAME)), version, LEASE_VERSION)
        try:
            return msgspec.json.decode(current.data, type=Lease), current.version
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("ignoring an unreadable driver lease at %s", self.storage.uri(self.path(LEASE_NAME)))
            return None, current.version

    def write_lease_if(self, lease: Lease, expected: str | None) -> str | None:
        """Write the lease only if it is still at version `expected` (None: absent); its new
        version, or None when another driver wrote it first."""
        return self._conditional().write_if(self.path(LEASE_NAME), msgspec.json.encode(lease), expected)

    def _conditional(self) -> ConditionalStore:
        if self._cas is None:
            self._cas = conditional(self.storage)
        return self._cas

    def fence(self, reason: str) -> None:
        """From now on write nothing to the run: another driver holds it."""
        if self.fenced is None:
            log.error("writing nothing more to run %s: %s", self.storage.uri(self.run_dir), reason)
        self.fenced = reason

    def _may_write(self, what: str) -> bool:
        if self.fenced is not None:
            log.info("not writing %s of run %s: this driver lost its lease", what, self.run_dir)
        return self.fenced is None
