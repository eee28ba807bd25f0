"""What the controller's core asks of storage, and what storage answers: effects out, events back in.

The core never calls storage. It returns one of these effects, each with an id; an executor
(`executor.py` on a thread of the driver, `outlast/sim/storage.py` on the simulator's clock)
carries them out in the order given, off the loop that sends heartbeats and answers ranks, and
each one's outcome comes back as an event with the same id. `storage_io.perform` is the one
place that turns an effect into storage calls, for both executors.

Order is the contract: effects are carried out one after another, in the order the core
returned them. A run-state write is of the latest state the core gave (an older one still
queued is not written: the newer includes it), so it is never behind what was committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from outlast.protocol.messages import FileEntry, Msg
from outlast.storage.records import Manifest

# ---- effects out ------------------------------------------------------------------------


@dataclass(frozen=True)
class WriteRunState:
    id: int
    data: bytes  # the run state, encoded when the core gave it
    names_commit: bool = False  # the first state to name a newly committed checkpoint


@dataclass(frozen=True)
class WriteManifest:
    """Phase one of a commit: the manifest is the commit point. The ranks hear `Committed` after it."""

    id: int
    manifest: Manifest


@dataclass(frozen=True)
class DeleteCheckpoint:
    """Retention: the run state stopped naming it in an earlier effect."""

    id: int
    checkpoint_dir: str


@dataclass(frozen=True)
class RemoveUncommitted:
    """Delete checkpoint directories without a manifest, except `keep`, and those of attempts from
    `from_attempt` on: a new attempt's ranks may be uploading by the time a slow storage reaches it."""

    id: int
    keep: frozenset[str]
    from_attempt: int | None = None


@dataclass(frozen=True)
class ReadManifests:
    """What a new attempt restores: read `candidates` (best first) until one is readable."""

    id: int
    candidates: tuple[str, ...]


@dataclass(frozen=True)
class ReadChecksums:
    """The stored copies of files that ranks wrote differently (file_merge.py): path -> algorithm."""

    id: int
    checkpoint_dir: str
    paths: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class CheckUploads:
    """Are these files in storage at these sizes? For an asynchronous upload whose rank exited before its
    done message came. Answered with `UploadsFound`."""

    id: int
    checkpoint_dir: str
    files: tuple[tuple[str, int], ...]  # (path under the checkpoint directory, size)


class EffectIds:
    """The ids of one core's effects, drawn by the core and by its commit machine (`commits/`) alike, so
    that an answer's id names one effect."""

    def __init__(self) -> None:
        self._last = 0

    def take(self) -> int:
        self._last += 1
        return self._last


StorageEffect = Union[WriteRunState, WriteManifest, DeleteCheckpoint, RemoveUncommitted, ReadManifests,
                      ReadChecksums, CheckUploads]
STORAGE_EFFECTS = (WriteRunState, WriteManifest, DeleteCheckpoint, RemoveUncommitted, ReadManifests, ReadChecksums,
                   CheckUploads)


def describe(effect: StorageEffect) -> str:
    """The effect in words, for the log and the progress line."""
    if isinstance(effect, WriteRunState):
        return "writing the run state"
    if isinstance(effect, WriteManifest):
        return f"writing the manifest of {effect.manifest.checkpoint_dir}"
    if isinstance(effect, DeleteCheckpoint):
        return f"deleting {effect.checkpoint_dir}"
    if isinstance(effect, RemoveUncommitted):
        return "removing uncommitted checkpoint directories"
    if isinstance(effect, ReadManifests):
        return f"reading the manifest of {effect.candidates[0]}" if effect.candidates else "reading manifests"
    if isinstance(effect, ReadChecksums):
        return f"reading back files of {effect.checkpoint_dir} that ranks wrote differently"
    return f"looking for the files of {effect.checkpoint_dir}"


@dataclass(frozen=True)
class TierAsk:
    """A request to a node's memory tier (`outlast/agent/tier_server.py`): keep a rank's copy, replicate
    it, mark a checkpoint committed. Carried out by `tier_executor.TierExecutor`, never by storage's."""

    id: int
    node_id: str
    address: str  # the node's tier server
    msg: Msg  # a TierHold, TierCommit or TierPull
    timeout_s: float = 600.0


# ---- events back in ---------------------------------------------------------------------


@dataclass(frozen=True)
class ManifestRead:
    """One candidate of `ReadManifests`: `ranks` when readable, `skip` when it cannot be restored,
    `unreadable` when storage failed (it is restored all the same: its workers retry), `newer` when a newer
    outlast wrote it (the run stops)."""

    checkpoint_dir: str
    ranks: tuple[int, ...] | None = None
    skip: str | None = None
    unreadable: str | None = None
    newer: str | None = None


@dataclass(frozen=True)
class StorageDone:
    """The effect `id` was carried out. A write or delete is answered with this; a read, or a write whose
    answer carries what it found, with the typed answers below."""

    id: int
    warning: str | None = None  # done, but not wholly: a refused delete


@dataclass(frozen=True)
class ManifestWritten(StorageDone):
    """`WriteManifest` is done: the manifest is the commit point."""


@dataclass(frozen=True)
class ChecksumsRead(StorageDone):
    """What `ReadChecksums` found: path -> (algorithm, digest) of the stored copy, None where it could not be read."""

    checksums: dict[str, tuple[str, str] | None] = field(default_factory=dict)


@dataclass(frozen=True)
class UploadsFound(StorageDone):
    """What `CheckUploads` found: `files` with their checksums (of the stored bytes) when every one is
    there at its size; else `missing`, each "path: why"."""

    files: tuple[FileEntry, ...] = ()
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class ManifestsRead(StorageDone):
    """What `ReadManifests` found, candidate by candidate until one can be restored (or a newer outlast wrote it)."""

    reads: tuple[ManifestRead, ...] = ()


@dataclass(frozen=True)
class StorageFailed:
    """The effect `id` still failed after its retries; `error` is what storage said."""

    id: int
    what: str
    error: str


@dataclass(frozen=True)
class StorageSlow:
    """The effect `id` has been running `for_s` seconds (it goes on)."""

    id: int
    what: str
    for_s: float


StorageEvent = Union[StorageDone, ManifestWritten, ChecksumsRead, UploadsFound, ManifestsRead, StorageFailed,
                     StorageSlow]


@dataclass(frozen=True)
class TierAnswered:
    """The tier request `id` was answered (`reply`, a TierStored or TierAck), or failed (`error`)."""

    id: int
    reply: object = None
    error: str = ""
