"""What the core hands the commit machine, and what the machine hands back for the core to apply.

Events in: a checkpoint the reports settled, what a report says of its copies, uploads to look
for in storage, the timers, the run's end, and the answers of storage and of the nodes' tiers
to what the machine asked. Out, in the order they happened: effects (storage calls, requests to
tiers) and outcomes. An outcome is what only the core may do: tell ranks, restart, change the
run's history, count an upload as ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from outlast.controller import effects as fx
from outlast.controller.commit import PendingCheckpoint
from outlast.protocol.messages import FileEntry
from outlast.storage.records import Manifest

# ---- events in ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settled:
    """Every rank's report (and upload) of this checkpoint is in (`commit.py`): commit it."""

    pending: PendingCheckpoint


@dataclass(frozen=True)
class Reported:
    """A report of a checkpoint: where the rank's own copy is on its node, and whether it goes to a peer's memory
    first instead of to storage (a notice's checkpoint, `peer.py`)."""

    attempt: int
    index: int
    rank: int
    local_dir: str
    through_peer: bool
    stored: bool = False  # local_dir is the checkpoint's directory in storage: it outlives the report


@dataclass(frozen=True)
class UploadsToCheck:
    """`rank` exited cleanly while these uploads of its had not said they were done: (report index, checkpoint,
    the files the upload began with, as (path, size))."""

    attempt: int
    rank: int
    uploads: tuple[tuple[int, str, tuple[tuple[str, int], ...]], ...]


@dataclass(frozen=True)
class Timers:
    """The core's timers ran: an upload from a node lost since never answers."""


@dataclass(frozen=True)
class RunEnded:
    """The run is over: a "storage" run frees its copies in the nodes' memory."""


Event = Union[Settled, Reported, UploadsToCheck, Timers, RunEnded, fx.ManifestWritten, fx.ChecksumsRead,
              fx.UploadsFound, fx.StorageFailed, fx.TierAnswered]

# ---- outcomes out: the core applies them ------------------------------------------------------


@dataclass(frozen=True)
class CommitDone:
    """The checkpoint is committed and its ranks may hear it now (if its attempt still runs)."""

    pending: PendingCheckpoint
    attempt: int


@dataclass(frozen=True)
class CommitRefused:
    """The checkpoint is not committed, and never will be; the latest committed one stays."""

    pending: PendingCheckpoint
    attempt: int
    reason: str


@dataclass(frozen=True)
class UploadsChecked:
    """What storage holds of an upload whose rank exited before its done message came: `files`, with their
    checksums, when every one is there at its size; else `missing`."""

    attempt: int
    rank: int
    index: int
    checkpoint_dir: str
    files: tuple[FileEntry, ...]
    missing: tuple[str, ...]


@dataclass(frozen=True)
class UploadsEnded:
    """The copies of these ranks' files for report `index` have answered: no upload of theirs is in flight."""

    index: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class HeadLost:
    """No checkpoint of this "memory" run can be committed again: the run cannot go on."""

    attempt: int
    why: str


@dataclass(frozen=True)
class DurableDone:
    """A checkpoint committed through a peer's memory is in storage now, or never will be: nothing waits on it."""

    checkpoint_dir: str


# History changes, as data: only the core changes the run's history.


@dataclass(frozen=True)
class RecordCommit:
    """The manifest is written: the history names the checkpoint (and retention may let older ones go)."""

    manifest: Manifest


@dataclass(frozen=True)
class NoteMemory:
    """Where a committed checkpoint's copies in memory are, rank by rank; `at`: when it became whole in memory."""

    checkpoint_dir: str
    holders: dict[int, list[str]]
    at: float | None


@dataclass(frozen=True)
class NoteFiles:
    """Each rank's own files of a checkpoint kept in memory, by name: what its loss with its nodes says was lost.
    Kept while the history names the checkpoint or `holding` does (the checkpoints whose copies are being made)."""

    checkpoint_dir: str
    files: dict[int, list[str]]
    holding: frozenset[str]


@dataclass(frozen=True)
class NoteDurable:
    """A checkpoint committed in memory is in storage now, its manifest rewritten to say so."""

    checkpoint_dir: str


@dataclass(frozen=True)
class NoteOnce:
    """A line for the history, kept once. `warn` is logged when it is new, `debug` when it was there already."""

    text: str
    warn: str = ""
    debug: str = ""


Outcome = Union[CommitDone, CommitRefused, UploadsChecked, UploadsEnded, HeadLost, DurableDone, RecordCommit,
                NoteMemory, NoteFiles, NoteDurable, NoteOnce]
Out = Union[fx.StorageEffect, fx.TierAsk, Outcome]
