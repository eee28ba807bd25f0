"""Every message that crosses a process boundary, in one place.

Messages are msgspec structs tagged by class name, encoded as msgpack. The user's
train function is the only pickle on the wire, and it travels as opaque bytes inside
`SpawnWorkers.payload`.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

PROTOCOL_VERSION = 1


class Msg(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Base of all wire messages."""


# ---- shared records -----------------------------------------------------------


class FileEntry(msgspec.Struct, frozen=True):
    path: str  # relative to the checkpoint directory, '/'-separated
    size: int
    sha256: str


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    world_size: int


class WorkerError(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker says about its own death before it exits (an error file)."""

    exc_type: str
    message: str
    traceback: str
    phase: str  # "setup" (before the train function ran) or "train"


# ---- driver (controller) <-> node agent ---------------------------------------


class Ping(Msg):
    pass


class Pong(Msg):
    node_id: str
    pid: int
    version: int = PROTOCOL_VERSION


class SpawnWorkers(Msg):
    run_id: str
    attempt: int
    controller_address: str
    workers: list[WorkerSpec]
    payload: bytes  # cloudpickled WorkerPayload
    env: dict[str, str]
    cwd: str
    sys_path: list[str]
    run_name: str
    restore_checkpoint: str | None  # directory name under the run's directory


class StopWorkers(Msg):
    run_id: str
    attempt: int
    grace_s: float


class RunHeartbeat(Msg):
    run_id: str
    timeout_s: float  # the agent kills the run's workers when no heartbeat came for this long


class EndRun(Msg):
    run_id: str


class WorkerStarted(Msg):
    run_id: str
    attempt: int
    rank: int
    pid: int


class WorkerExited(Msg):
    run_id: str
    attempt: int
    rank: int
    pid: int
    exit_code: int | None  # None when killed by a signal
    signal: int | None
    error: WorkerError | None
    node_id: str


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    attempt: int
    rank: int
    pid: int
    rss_bytes: int


class StatusRequest(Msg):
    pass


class StatusReply(Msg):
    node_id: str
    pid: int
    address: str
    started_at: float
    runs: list[str]
    workers: list[WorkerInfo]
    preload: list[str]
    zygote_ready: bool


class Shutdown(Msg):
    pass


class ShutdownAck(Msg):
    pass


# ---- worker -> controller -------------------------------------------------------


class WorkerHello(Msg):
    attempt: int
    rank: int
    pid: int


class Report(Msg):
    attempt: int
    rank: int
    index: int
    metrics: dict[str, Any]
    checkpoint_dir: str | None = None  # set by a rank that uploaded files
    files: list[FileEntry] = []


class CollectiveRequest(Msg):
    attempt: int
    rank: int
    seq: int
    op: str  # "barrier" | "broadcast"
    payload: bytes | None = None  # rank 0's pickled object for a broadcast


class WorkerDone(Msg):
    attempt: int
    rank: int
    reports: int


# ---- controller -> worker -------------------------------------------------------


class Committed(Msg):
    index: int
    checkpoint_dir: str


class CommitFailed(Msg):
    index: int
    reason: str


class CollectiveReply(Msg):
    seq: int
    payload: bytes | None = None


class CollectiveTimeout(Msg):
    seq: int
    op: str
    missing_ranks: list[int]
    waited_s: float


AgentRequest = Union[Ping, SpawnWorkers, StopWorkers, RunHeartbeat, EndRun, StatusRequest, Shutdown]
AgentEvent = Union[Pong, WorkerStarted, WorkerExited, StatusReply, ShutdownAck]
WorkerMessage = Union[WorkerHello, Report, CollectiveRequest, WorkerDone]
ControllerToWorker = Union[Committed, CommitFailed, CollectiveReply, CollectiveTimeout]


# ---- node agent <-> its fork server (the zygote) ---------------------------------


class ForkWorker(Msg):
    run_id: str
    attempt: int
    spec: WorkerSpec
    controller_address: str
    payload: bytes
    env: dict[str, str]
    cwd: str
    sys_path: list[str]
    run_name: str
    restore_checkpoint: str | None
    node_id: str
    error_file: str


class ZygoteReady(Msg):
    preloaded: list[str]
    failed: dict[str, str]  # module -> why it did not import


class Forked(Msg):
    run_id: str
    attempt: int
    rank: int
    pid: int


class Reaped(Msg):
    run_id: str
    attempt: int
    rank: int
    pid: int
    exit_code: int | None
    signal: int | None
    error: WorkerError | None


ToZygote = ForkWorker
FromZygote = Union[ZygoteReady, Forked, Reaped]
