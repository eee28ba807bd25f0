"""The commit machine's data: commits on their way, copies in the nodes' memory, and one typed record for each
request in flight, found by its effect id when the answer comes (`Asks`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, TypeVar, Union

from outlast.controller import effects as fx
from outlast.controller.commit import PendingCheckpoint
from outlast.controller.commits.events import Out
from outlast.controller.file_merge import MergedFiles
from outlast.protocol import messages as m
from outlast.storage.records import Manifest


@dataclass(frozen=True)
class Committing:
    """A manifest handed to storage, not yet said to be written."""

    pending: PendingCheckpoint
    attempt: int
    manifest: Manifest


@dataclass(frozen=True)
class MemoryCommit:
    """A commit that waits for every rank's node to keep its files in memory; then its manifest is written."""

    pending: PendingCheckpoint
    attempt: int
    files: list[m.FileEntry]
    seq: int
    through_peer: bool  # a notice's checkpoint: storage follows, from the nodes' memory


@dataclass
class Holding:
    """One checkpoint's copies in the nodes' memory, while they are being made and after."""

    checkpoint_dir: str
    index: int  # the report it came with
    attempt: int
    seq: int
    node_of: dict[int, str]  # rank -> its node
    files: dict[int, list[m.FileEntry]]
    asked: set[int] = field(default_factory=set)  # ranks whose node was asked to keep their files
    after_commit: dict[int, str] = field(default_factory=dict)  # rank -> storage's directory, copied once committed
    waiting: set[int] = field(default_factory=set)  # ranks whose first answer has not come
    holders: dict[int, set[str]] = field(default_factory=dict)  # rank -> nodes that keep its files
    refused: dict[int, str] = field(default_factory=dict)  # rank -> why it has no copy (or no replica)
    committed: bool = False
    tell: Committing | None = None  # a commit whose ranks hear it once `waiting` is empty
    on_all: MemoryCommit | None = None  # "memory": the commit that goes on once every rank answered
    told_commit: set[str] = field(default_factory=set)  # nodes sent a TierCommit


@dataclass
class Durable:
    """A checkpoint committed in memory for a notice, on its way to storage."""

    holders: dict[int, list[str]]  # rank -> nodes to upload its files from, in the order to try them
    manifest: Manifest | None = None  # once written (durable: false)
    left: set[int] = field(default_factory=set)
    asked: dict[int, tuple[str, int]] = field(default_factory=dict)  # rank -> (node, request id) in flight
    failed: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0  # the slowest rank's upload


# ---- what each request in flight is for -----------------------------------------------------------


@dataclass(frozen=True)
class ManifestWrite:
    """Phase one of a commit (`WriteManifest`)."""

    committing: Committing


@dataclass(frozen=True)
class ChecksumRead:
    """The stored copies of files that ranks wrote differently (`ReadChecksums`), before the commit goes on."""

    pending: PendingCheckpoint
    attempt: int
    merged: MergedFiles


@dataclass(frozen=True)
class UploadCheck:
    """An upload whose rank exited before its done message came (`CheckUploads`)."""

    attempt: int
    rank: int
    index: int
    checkpoint_dir: str


@dataclass(frozen=True)
class DurableWrite:
    """The manifest of a checkpoint committed through a peer, written again once storage holds it all."""

    durable: Durable


@dataclass(frozen=True)
class LocalCopy:
    """"storage": a rank's node copies its files into its memory, beside the durable commit."""

    holding: Holding
    rank: int


@dataclass(frozen=True)
class Replica:
    """"storage": a copy kept goes on to a peer in another failure domain."""

    holding: Holding
    rank: int


@dataclass(frozen=True)
class MemoryCopy:
    """"memory" (or a notice's checkpoint through a peer): a rank's node keeps its files and pushes the replica."""

    holding: Holding
    rank: int


@dataclass(frozen=True)
class Told:
    """A node that holds a copy was told its checkpoint is committed (`TierCommit`); its answer changes nothing."""


@dataclass(frozen=True)
class Upload:
    """A node uploads a rank's files from its memory to storage (`TierUpload`)."""

    durable: Durable
    rank: int
    checkpoint_dir: str


@dataclass(frozen=True)
class Free:
    """The run is over: a node frees its copies (`TierFree`)."""


StorageAsk = Union[ManifestWrite, ChecksumRead, UploadCheck, DurableWrite]
TierRequest = Union[LocalCopy, Replica, MemoryCopy, Told, Upload, Free]
Ask = TypeVar("Ask", ManifestWrite, ChecksumRead, UploadCheck, DurableWrite)


class Asks:
    """The machine's requests in flight, each with its record, by effect id."""

    def __init__(self, ids: fx.EffectIds) -> None:
        self._ids = ids
        self.storage: dict[int, StorageAsk] = {}
        self.tiers: dict[int, TierRequest] = {}

    def store(self, out: list[Out], make: Callable[[int], fx.StorageEffect], record: StorageAsk) -> int:
        """Hand storage an effect, carried out after every earlier one."""
        effect_id = self._ids.take()
        self.storage[effect_id] = record
        out.append(make(effect_id))
        return effect_id

    def tier(self, out: list[Out], node_id: str, address: str, msg: m.Msg, record: TierRequest, timeout_s: float) -> int:
        """Ask a node's memory tier."""
        effect_id = self._ids.take()
        out.append(fx.TierAsk(effect_id, node_id, address, msg, timeout_s))
        self.tiers[effect_id] = record
        return effect_id

    def of(self, kind: type[Ask]) -> list[Ask]:
        """The storage requests in flight of one kind, oldest first."""
        return [r for r in self.storage.values() if isinstance(r, kind)]
