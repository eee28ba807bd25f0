"""The documents a run keeps on storage: checkpoint manifests and the run state.

Both are versioned JSON. A newer outlast reads an older version; an unknown future
version is refused with a message instead of being misread.
"""

from __future__ import annotations

import functools
import signal as _signal
from typing import Any, Callable, TypeVar

import msgspec

from outlast.protocol import paths
from outlast.protocol.kinds import NODE_KINDS, FailureKind
from outlast.protocol.messages import FileEntry
from outlast.storage.metric_values import restored, stored

MANIFEST_NAME = ".outlast-manifest.json"
RUN_STATE_NAME = "run_state.json"
LEASE_NAME = "driver_lease.json"
RETURN_VALUE_NAME = "return_value.pkl"  # rank 0's return value, written when its train function returns
REPORTS_DIR = "reports"  # beside the run state: rank 0's reports, in ReportSegment documents
REPORTS_PER_SEGMENT = 1000
SCHEMA_VERSION = 1
# Run states: 2 keeps outlast's own kind of a failure in `FailureRecord.kind`, apart from the name of the
# exception a rank raised (`exc_type`), where 1 kept both; a run state of 1 is read as 2 (`_kinds_apart`).
RUN_STATE_VERSION = 2
# Manifests: 1 had sha256 for every file; 2 has xxh3_128. A restore reads both.
MANIFEST_VERSION = 2

_Doc = TypeVar("_Doc", bound=msgspec.Struct)
_Rec = TypeVar("_Rec", "CheckpointRecord", "ReportEntry")  # the records that carry metrics


class FailureRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's death, kept as data so it can be shown later, root cause first.

    `exc_type` is the name of the exception the rank's process raised (None: it raised none); `kind` is what
    outlast knows the failure to be (a lost node, a hang, a preemption, ...), set by outlast alone. A corrupt
    checkpoint has both: the rank raised CorruptCheckpointError, and outlast knows what that means."""

    attempt: int
    rank: int
    node_id: str
    pid: int
    exit_code: int | None
    signal: int | None
    time: float
    exc_type: str | None = None
    kind: FailureKind | None = None
    message: str | None = None
    traceback: str | None = None
    phase: str | None = None
    oom_report: str | None = None  # set when outlast killed the worker for memory: the kill report

    def describe(self) -> str:
        if self.kind in NODE_KINDS:  # about a node, not one process
            return f"attempt {self.attempt}: {self.message}"
        pid = f"pid {self.pid}, " if self.pid else ""
        where = f"rank {self.rank} ({pid}node {self.node_id}, attempt {self.attempt})"
        if self.kind is FailureKind.NODE_LOST:
            return f"{where} was lost with its node: {self.message}"
        if self.oom_report:
            return f"{where} was killed by outlast for memory (OOM kill):\n{self.oom_report}"
        if self.named:
            return f"{where} raised {self.named}: {self.message}"
        if self.signal is not None:
            return f"{where} was killed by {signal_name(self.signal)}"
        return f"{where} exited with code {self.exit_code}"

    @property
    def named(self) -> str | None:
        """What the failure is called: the exception the rank raised, else outlast's kind of it (None: neither)."""
        return self.exc_type or (self.kind.value if self.kind is not None else None)


def signal_name(signum: int) -> str:
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Manifest(msgspec.Struct, kw_only=True):
    version: int = MANIFEST_VERSION
    checkpoint_dir: str
    seq: int
    attempt: int
    report_index: int
    committed_at: float
    ranks: list[int]
    files: list[FileEntry]
    metrics: dict[str, Any] = {}
    # Its level when committed (docs/guide/memory-tier.md): the nodes keeping its files in memory, and
    # whether its files are in storage_path. Older manifests: durable, in no node's memory.
    memory: list[str] = []
    memory_at: float | None = None
    durable: bool = True
    memory_ranks: dict[int, list[str]] = {}  # rank -> the nodes that keep its files (additive: older have none)
    # rank -> where it was in its data when it reported (train/data_position.py's document; additive: older
    # manifests and runs that read no data through outlast have none). Checked by the reader, not here.
    data_positions: dict[int, str] = {}

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir)  # a restore joins it to its directories


class OutputFile(msgspec.Struct, frozen=True, kw_only=True):
    """Where a rank's stdout and stderr of one attempt are kept: a file on its node."""

    rank: int
    node_id: str
    path: str


class AttemptRecord(msgspec.Struct, kw_only=True):
    attempt: int
    started_at: float
    restored_from: str | None = None
    ended_at: float | None = None
    outcome: str | None = None  # "finished" | "failed" | "aborted" | "driver_lost" | "resized"
    failures: list[FailureRecord] = []
    outputs: list[OutputFile] = []  # additive under version 1: older readers ignore it
    workers: int | None = None  # the attempt's world size, once placed
    # The window it waited for capacity (additive under version 2): from the first placement that found none to
    # the one that found some (None: still waiting, or it never had to).
    waiting_since: float | None = None
    capacity_at: float | None = None


class ResizeRecord(msgspec.Struct, frozen=True, kw_only=True):
    """An elastic run changed size between two attempts (drawing on no failure budget)."""

    attempt: int  # the attempt that runs at the new size
    from_workers: int
    to_workers: int
    reason: str
    steps_lost: int  # reports made after the newest committed checkpoint the new attempt restores
    time: float


class LiveRecoveryRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A rank's death in a run with live recovery, charged to max_failures: the survivors went on and a
    replacement took the state from them (`path` "live"), or the attempt restarted from the newest checkpoint
    ("restart", with `reason`)."""

    attempt: int
    ranks: list[int]  # the ranks replaced (a death during the transfer adds one)
    cause: str  # the first death, as FailureRecord.describe() says it
    path: str  # "live" or "restart"
    time: float  # the first death
    generation: int = 0  # the live group's generation that took the state (path "live")
    steps_lost: int | None = None  # steps the survivors threw away (0 or 1); None on a restart
    seconds: float | None = None  # from the death to the state received; None on a restart
    reason: str = ""


class CheckpointRecord(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_dir: str
    seq: int
    attempt: int
    report_index: int
    committed_at: float
    metrics: dict[str, Any] = {}
    # Where it is held: the nodes with a copy in memory (since `memory_at`, every rank's files on two
    # nodes in different failure domains), and in storage_path unless `durable` is false.
    memory: list[str] = []
    memory_at: float | None = None
    durable: bool = True
    # rank -> the nodes that keep its files in memory: the checkpoint is restorable from memory while every rank
    # has one that lives. Empty in records of older versions: then `memory` is all that is known.
    memory_ranks: dict[int, list[str]] = {}


class SkippedCheckpoint(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_dir: str
    reason: str
    time: float
    # Kept in memory only and lost with its nodes: the reports between it and the checkpoint restored instead,
    # which the run trains again. None for a checkpoint skipped for another cause (unreadable, corrupt).
    steps_lost: int | None = None


class RunNote(msgspec.Struct, frozen=True, kw_only=True):
    """Something the run did on the user's behalf that they should know (e.g. a dropped duplicate file)."""

    text: str
    time: float


class DrainRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A drain that reached an attempt's nodes: the window from the notice to its deadline."""

    attempt: int
    node_ids: list[str]
    reason: str
    message: str
    time: float  # wall time the notice reached the run
    deadline: float | None  # wall time the nodes go away; None: no deadline given
    ranks: list[int] = []  # the ranks on those nodes


class RunState(msgspec.Struct, kw_only=True):
    version: int = RUN_STATE_VERSION
    name: str
    status: str  # the controller state's name
    created_at: float
    updated_at: float
    attempts: list[AttemptRecord] = []
    failure_counts: dict[str, int] = {}
    checkpoints: list[CheckpointRecord] = []
    latest_checkpoint: str | None = None
    skipped_checkpoints: list[SkippedCheckpoint] = []
    last_metrics: dict[str, Any] | None = None  # rank 0's last report
    error: str | None = None
    waiting_for: str | None = None  # while status is waiting_for_capacity: what is missing
    notes: list[RunNote] = []
    resizes: list[ResizeRecord] = []
    hangs: list[HangRecord] = []
    drains: list[DrainRecord] = []  # additive under version 1: older readers ignore it
    live_recoveries: list[LiveRecoveryRecord] = []  # additive too


class StackGroup(msgspec.Struct, frozen=True, kw_only=True):
    """Ranks whose stacks are the same but for thread ids: the stacks of the first, every thread."""

    ranks: list[int]
    where: str  # the innermost frame of their main thread
    text: str


class HangRecord(msgspec.Struct, frozen=True, kw_only=True):
    attempt: int
    time: float
    summary: str
    stacks: list[StackGroup] = []


class ReportEntry(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One of rank 0's reports: its index in the attempt, the wall time it arrived, its metrics, and the seconds
    since the report before it that rank 0 spent in `report()` with a checkpoint (`Report.stalled_s`).

    Additive under the same version: an entry is an array, and a reader of either version takes the fields it
    knows from the front and the default for one missing at the end."""

    index: int
    time: float
    metrics: dict[str, Any]
    stalled_s: float = 0.0


class ReportSegment(msgspec.Struct, kw_only=True):
    """Rank 0's reports of one attempt, up to REPORTS_PER_SEGMENT of them, from `first_index` on.

    The driver rewrites the newest segment as reports arrive, so the history of every metric
    survives the driver and is read from storage alone."""

    version: int = SCHEMA_VERSION
    attempt: int
    first_index: int
    reports: list[ReportEntry] = []


class CorruptDocument(ValueError):
    """A manifest or run-state file that cannot be read; the message names the file."""


# The most outlast reads of one document from storage. Whoever can write the storage path writes what the
# driver reads, and a reader that took a file whole would give that writer the driver's memory. outlast's own
# are far smaller: a run state of 10,000 attempts, a manifest of 100,000 files or a report segment of
# REPORTS_PER_SEGMENT reports each stay under 64 MiB; a lease or a checkpoint's marker is a few hundred bytes.
MAX_DOCUMENT_BYTES = 64 << 20
MAX_SMALL_DOCUMENT_BYTES = 1 << 20


class DocumentTooLarge(CorruptDocument):
    """A document larger than outlast writes of its kind: not read past the limit, so never taken whole."""

    def __init__(self, where: str, limit: int) -> None:
        super().__init__(f"{where} is larger than outlast writes of such a document ({limit:,} bytes): it was "
                         "not read. Look at what wrote it; move it out of the run's directory to go on without it")
        self.where, self.limit = where, limit


class NewerVersionError(RuntimeError):
    """A manifest or run-state file written by a newer outlast: refused as it is, never set aside or rebuilt,
    since what this version would write over it loses what the newer one recorded."""

    def __init__(self, where: str, version: int, newest: int) -> None:
        super().__init__(
            f"{where} has schema version {version}, written by a newer outlast; this outlast ({_own_version()}) "
            f"reads versions up to {newest}. Nothing was changed: upgrade outlast to the version that wrote it "
            "(or newer) to go on with this run, or choose another RunConfig(name=...) to start a new one")
        self.where, self.version, self.newest = where, version, newest

    def __reduce__(self) -> tuple[type[NewerVersionError], tuple[str, int, int]]:
        return (type(self), (self.where, self.version, self.newest))


@functools.cache
def _own_version() -> str:
    """Read from the package's metadata once: a directory of newer runs asks it for each."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("outlast")
    except PackageNotFoundError:
        return "not installed as a package"


def encode(doc: msgspec.Struct) -> bytes:
    return msgspec.json.format(msgspec.json.encode(with_metrics(doc, stored)), indent=2)


def encode_compact(doc: msgspec.Struct) -> bytes:
    """For documents rewritten often and read by programs alone (report segments)."""
    return msgspec.json.encode(with_metrics(doc, stored))


def with_metrics(doc: _Doc, fn: Callable[[Any], Any]) -> _Doc:
    """`doc` with `fn` applied to each of its metrics dicts (metric_values says why); `doc` itself when
    nothing changed, as the controller's own state must stay as it is."""
    if isinstance(doc, RunState):
        last = fn(doc.last_metrics) if doc.last_metrics is not None else None
        checkpoints = _each(doc.checkpoints, fn)
        if last is doc.last_metrics and checkpoints is doc.checkpoints:
            return doc
        return msgspec.structs.replace(doc, last_metrics=last, checkpoints=checkpoints)
    if isinstance(doc, ReportSegment):
        reports = _each(doc.reports, fn)
        return doc if reports is doc.reports else msgspec.structs.replace(doc, reports=reports)
    if isinstance(doc, Manifest):
        metrics = fn(doc.metrics)
        return doc if metrics is doc.metrics else msgspec.structs.replace(doc, metrics=metrics)
    return doc


def _each(records: list[_Rec], fn: Callable[[Any], Any]) -> list[_Rec]:
    out = [r if (v := fn(r.metrics)) is r.metrics else msgspec.structs.replace(r, metrics=v) for r in records]
    return records if all(a is b for a, b in zip(out, records)) else out


class DocumentVersion(msgspec.Struct):
    version: int = SCHEMA_VERSION


def decode(data: bytes, kind: type[_Doc], where: str) -> _Doc:
    # The version first: a newer schema may have changed fields, and the user should be told
    # to upgrade rather than that the file is corrupt.
    newest = {Manifest: MANIFEST_VERSION, RunState: RUN_STATE_VERSION}.get(kind, SCHEMA_VERSION)
    try:
        version = msgspec.json.decode(data, type=DocumentVersion).version
    except (msgspec.DecodeError, msgspec.ValidationError):
        version = newest
    if version > newest:
        raise NewerVersionError(where, version, newest)
    try:
        doc = with_metrics(msgspec.json.decode(data, type=kind), restored)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CorruptDocument(f"{where} is not a valid {kind.__name__} document ({e})") from None
    if isinstance(doc, RunState) and version < 2:
        _kinds_apart(doc)
    return doc


# The spellings outlast's kinds had in `exc_type` in run states of version 1.
_KINDS_BY_OLD_NAME = {k.value: k for k in FailureKind}


def _kinds_apart(state: RunState) -> None:
    """Make a run state of version 1 one of version 2: a failure whose `exc_type` spelled one of outlast's kinds
    has it as its `kind` (CorruptCheckpointError stays its exception's name too: the rank raised it)."""
    for a in state.attempts:
        a.failures = [_kind_apart(f) for f in a.failures]
    state.version = RUN_STATE_VERSION


def _kind_apart(f: FailureRecord) -> FailureRecord:
    kind = _KINDS_BY_OLD_NAME.get(f.exc_type) if f.exc_type is not None and f.kind is None else None
    if kind is None:
        return f
    raised = f.exc_type if kind is FailureKind.CORRUPT_CHECKPOINT else None
    return msgspec.structs.replace(f, kind=kind, exc_type=raised)


def report_segment_name(attempt: int, first_index: int) -> str:
    return f"{REPORTS_DIR}/{attempt:04d}_{first_index:08d}.json"

