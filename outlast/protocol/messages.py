"""Every message that crosses a process boundary, in one place.

Messages are msgspec structs tagged by class name, encoded as msgpack. The user's
train function is the only pickle on the wire, and it travels as opaque bytes inside
`SpawnWorkers.payload`.

Every path or name that a receiver joins to a directory is checked by its struct's `__post_init__`
(`outlast/protocol/paths.py`), which msgspec runs when it decodes: such a message is refused whole.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from outlast.protocol import paths
from outlast.protocol.kinds import FailureKind, WorkloadKind

# 2: every frame starts with outlast/protocol/transport.py's HEADER; 3: CheckpointsQuery; 4: SetUp;
# 5: WorkerError.kind, apart from exc_type; 6: Report.stalled_s, data_position and local_dir_stored
PROTOCOL_VERSION = 6


class Msg(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Base of all wire messages.

    Each subclass says `frozen=True` again: msgspec passes it down at run time, but a type checker
    reads a struct through PEP 681's dataclass_transform, which does not, and would take the
    subclass for a mutable one.
    """


# ---- shared records -----------------------------------------------------------


class FileEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    path: str  # relative to the checkpoint directory, '/'-separated
    size: int
    sha256: str | None = None  # what manifests of version 1 carry
    xxh3_128: str | None = None  # what outlast writes now

    @property
    def checksum(self) -> tuple[str, str]:
        """(algorithm, hex digest); xxh3_128 when the entry has it."""
        if self.xxh3_128 is not None:
            return "xxh3_128", self.xxh3_128
        if self.sha256 is not None:
            return "sha256", self.sha256
        raise ValueError(f"manifest entry {self.path!r} has no checksum")

    def __post_init__(self) -> None:
        paths.check_relative("file", self.path)


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    world_size: int


class Resources(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker or task asks of its node."""

    num_cpus: float = 1.0
    memory_bytes: int = 0  # 0: no request


class ConsideredWorker(msgspec.Struct, frozen=True, kw_only=True):
    """One worker as the kill policy saw it."""

    name: str  # its cgroup leaf
    kind: WorkloadKind
    owner: str  # run id or task id
    rank: int | None
    pid: int
    memory_bytes: int
    resources: Resources
    age_s: float
    work_at_risk_s: float  # what killing it throws away (training: x the run's worker count)
    idle: bool
    retriable: bool
    selected: bool


class KillReport(msgspec.Struct, frozen=True, kw_only=True):
    """Why outlast killed workers for memory: the node, the trigger, everyone considered."""

    node_id: str
    time: float
    trigger: str
    usage_bytes: int  # what counted against the limit when the policy ran
    limit_bytes: int  # the workloads' limit (total - reserved)
    node_total_bytes: int
    target_bytes: int  # the policy killed until usage would be below this
    policy: str
    considered: list[ConsideredWorker]
    selected: list[str]  # names of the selected workers, in kill order
    reason: str


class WorkerError(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker says about its own death before it exits (an error file), or what its node or its
    controller knows of it (`kind`: a fork server that died, a lost node, ...)."""

    exc_type: str | None = None  # the name of the exception the worker raised
    kind: FailureKind | None = None  # outlast's own kind of the failure (FailureRecord.kind)
    message: str
    traceback: str
    phase: str  # "setup" (before the train function ran) or "train"


# ---- driver (controller) <-> node agent ---------------------------------------


class Ping(Msg, frozen=True):
    pass


class Pong(Msg, frozen=True):
    node_id: str
    pid: int
    version: int = PROTOCOL_VERSION
    head_address: str = ""  # the cluster's head; empty when this agent is the head


class SpawnWorkers(Msg, frozen=True):
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
    resources: dict[str, float] = {}  # what each of these workers holds on the node while it runs
    # Where the run lives ({storage_path}/{name}): a relaunched driver's run has the same key,
    # and the workers of its dead predecessor must not go on beside the new ones.
    run_key: str = ""
    forward_output: bool = True  # send the workers' output lines to the controller (`WorkerOutput`)
    # The agent the controller placed on, from the node table: an agent started since at the same address
    # (a persistent node restarted) refuses, as the table that chose it was out of date. 0: any.
    agent_pid: int = 0

    def __post_init__(self) -> None:
        # The agent names each rank's error and output files after these.
        paths.check_name("run id", self.run_id)
        paths.check_name("run name", self.run_name, empty_ok=True)
        paths.check_name("checkpoint", self.restore_checkpoint)


class StopWorkers(Msg, frozen=True):
    run_id: str
    attempt: int
    grace_s: float


class KillRanks(Msg, frozen=True):
    """SIGKILL these ranks of an attempt now, leaving its other ranks running (live recovery: a hung rank, whose
    peers wait in a collective with it, is killed and replaced; a SIGSTOPped process dies of SIGKILL alone)."""

    run_id: str
    attempt: int
    ranks: list[int]
    reason: str


class RunHeartbeat(Msg, frozen=True):
    run_id: str
    timeout_s: float  # the agent kills the run's workers when no heartbeat came for this long
    # Wall-clock time (time.time()) of the run's latest committed checkpoint, None before the
    # first: the kill policy weighs a training worker by the work since then.
    last_commit_at: float | None = None
    # Wall-clock time the checkpoint the loop saved for a drain of this attempt's nodes was committed; None
    # until then. Another checkpoint committed after the drain (one reported before its ranks heard of it)
    # is not it: what a Slurm job waits for before it is requeued.
    saved_for_drain_at: float | None = None


class EndRun(Msg, frozen=True):
    run_id: str


class WorkerStarted(Msg, frozen=True):
    run_id: str
    attempt: int
    rank: int
    pid: int
    output_file: str = ""  # the rank's stdout and stderr, kept on its node


class WorkerOutput(Msg, frozen=True):
    """Lines a rank wrote to stdout or stderr, in the order it wrote them (docs/architecture.md, worker output).

    `seq` numbers the first line among every line the rank wrote; a gap before it is lines
    not forwarded (skipped by a node that fell behind, or lost on the way), counted by the driver."""

    run_id: str
    attempt: int
    rank: int
    node_id: str
    seq: int
    lines: list[str]
    task_id: str = ""  # an Executor task's lines (attempt 0, rank -1)


class WorkerExited(Msg, frozen=True):
    run_id: str
    attempt: int
    rank: int
    pid: int
    exit_code: int | None  # None when killed by a signal
    signal: int | None
    error: WorkerError | None
    node_id: str
    kill_report: KillReport | None = None  # set when outlast killed it for memory
    oom_report: str | None = None  # the same, as text for the run's history


class SpawnTask(Msg, frozen=True):
    """One task of an `outlast.Executor` (its session is `run_id`, kept alive by RunHeartbeat)."""

    run_id: str
    task_id: str
    controller_address: str  # where the task sends its TaskResult
    payload: bytes  # cloudpickled (fn, args, kwargs)
    env: dict[str, str]
    cwd: str
    sys_path: list[str]
    resources: Resources = Resources()
    retriable: bool = True

    def __post_init__(self) -> None:
        paths.check_name("run id", self.run_id)  # the agent names the task's output file after these
        paths.check_name("task id", self.task_id)


class TaskExited(Msg, frozen=True):
    run_id: str
    task_id: str
    pid: int
    exit_code: int | None
    signal: int | None
    error: WorkerError | None
    node_id: str
    kill_report: KillReport | None = None
    oom_report: str | None = None


class TaskResult(Msg, frozen=True):
    """A task's outcome, sent by the task process itself before it exits."""

    task_id: str
    ok: bool
    payload: bytes  # cloudpickled return value, or the exception when not ok
    error: WorkerError | None = None


class NodeDraining(Msg, frozen=True):
    """The node will go away (a preemption, a maintenance): its workers' runs should save and move."""

    node_id: str
    reason: str
    message: str
    deadline_unix_s: float | None
    # Every node drained with it: a drain on one node of a failure domain drains the domain.
    node_ids: list[str] = []
    # The nodes go away as soon as the checkpoint this drain asks for is committed (a Slurm job is
    # requeued then), whatever the deadline: a step trained after that commit would be lost.
    until_commit: bool = False


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    attempt: int
    rank: int
    pid: int
    rss_bytes: int
    task_id: str = ""
    memory_bytes: int = 0  # of its cgroup leaf, with isolation on
    resources: Resources = Resources()


class IsolationInfo(msgspec.Struct, frozen=True, kw_only=True):
    cgroup_version: int
    root: str  # the node's cgroup subtree (v1: its memory hierarchy path)
    total_memory: int
    system_reserved_memory: int
    user_limit: int
    total_cpus: float
    system_reserved_cpus: float
    system_memory: int  # current usage of the system cgroup
    user_memory: int  # current usage of the user cgroup
    counted_memory: int  # anon of workloads plus all shared memory: what the policy judges
    monitors: list[str]
    kills: int


class StatusRequest(Msg, frozen=True):
    pass


class StoreHealth(msgspec.Struct, frozen=True, kw_only=True):
    """Where the cluster's state lives and whether it can be written: "head" (one agent) or "etcd"."""

    kind: str
    available: bool = True
    unavailable_since_unix: float | None = None  # when the last call with a majority behind it succeeded
    detail: str = ""  # why not, in etcd's or the network's words
    head: str = ""  # the node holding the head role, if any


class StatusReply(Msg, frozen=True):
    node_id: str
    pid: int
    address: str
    started_at: float
    runs: list[str]
    workers: list[WorkerInfo]
    preload: list[str]
    zygote_ready: bool
    isolation: IsolationInfo | None = None
    recent_kills: list[KillReport] = []
    capacity: Resources | None = None  # what workloads may use on this node
    draining: NodeDraining | None = None
    head_address: str = ""  # empty when this agent is the head
    nodes: list["NodeInfo"] = []  # the node table (the head only)
    run_commits: dict[str, float] = {}  # run id -> wall time of its latest commit this attempt (heartbeats)
    run_drain_saves: dict[str, float] = {}  # run id -> when the checkpoint it saved for a drain committed (heartbeats)
    metrics_url: str = ""  # where the node's Prometheus metrics are served; empty when off
    fork_server_pid: int = 0
    fork_server_standby_pid: int = 0  # the standby that takes the server's place when it dies; 0: none
    fork_server_cuda: str = ""  # what of CUDA the fork server initialized ("": nothing, as it must)
    gpus: dict[str, list[str]] = {}  # each GPU id of the node -> the workers holding it (run/attempt/rank)
    store: StoreHealth | None = None  # the cluster store, where it is not this agent alone


class DrainNode(Msg, frozen=True):
    """`outlast drain-node`: this node will go away; its runs should save and move elsewhere."""

    node_id: str
    reason: str
    message: str
    deadline_remaining_s: float | None
    # More nodes drained with it, as one drain: every run hears one notice naming them all (a whole
    # Slurm job preempted), not a notice per node that its ranks may see one at a time.
    also: list[str] = []
    until_commit: bool = False  # NodeDraining.until_commit


class DrainAck(Msg, frozen=True):
    node_id: str
    runs_notified: int
    node_ids: list[str] = []  # every node drained (the failure domain of node_id)


class DrainRefused(Msg, frozen=True):
    reason: str


# ---- node agents <-> the head: the node table -------------------------------------


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A node as the head knows it."""

    node_id: str
    address: str  # its agent's socket, e.g. tcp://10.0.0.2:6380
    host: str  # where its workers can be reached (torch.distributed's MASTER_ADDR when rank 0 runs there)
    resources: dict[str, float]  # what workloads may use: {"CPU": 8, "GPU": 0, "memory": 3.2e10, ...}
    labels: dict[str, str] = {}
    failure_domain: str = ""  # a TPU slice, a rack: a drain on one node drains the domain
    state: str = "alive"  # alive | draining | dead
    draining: NodeDraining | None = None
    used: dict[str, dict[str, float]] = {}  # run id -> resources its workers hold here
    last_seen_unix: float = 0.0
    is_head: bool = False
    agent_pid: int = 0  # with host_id: a process on the same host sees at once when the agent is gone
    host_id: str = ""  # boot id and pid namespace (outlast/client/liveness.py)
    tier_address: str = ""  # its memory tier's server (outlast/agent/tier_server.py); empty: no tier


class RegisterNode(Msg, frozen=True):
    node: NodeInfo


class NodeHeartbeat(Msg, frozen=True):
    node_id: str
    used: dict[str, dict[str, float]] = {}
    draining: NodeDraining | None = None


class HeartbeatAck(Msg, frozen=True):
    known: bool  # False: the head does not know this node (it restarted); register again


class ListNodes(Msg, frozen=True):
    pass


class ReadOutput(Msg, frozen=True):
    """`outlast runs --logs` from another machine: the last lines of a rank's output file on this node."""

    path: str
    lines: int


class OutputLines(Msg, frozen=True):
    path: str
    lines: list[str]
    error: str = ""  # set, and no lines, when the file cannot be read (or is not one of the node's)


class NodeList(Msg, frozen=True):
    nodes: list[NodeInfo]


class SpawnRefused(Msg, frozen=True):
    """The node takes no new workers (it is draining); the controller waits for capacity."""

    run_id: str
    attempt: int
    reason: str


class Shutdown(Msg, frozen=True):
    pass


class ShutdownAck(Msg, frozen=True):
    pass


# ---- worker -> controller -------------------------------------------------------


class WorkerHello(Msg, frozen=True):
    attempt: int
    rank: int
    pid: int
    set_up: bool = False  # True: the rank has no set-up of outlast's to do (the simulator's ranks); else SetUp says


class Welcome(Msg, frozen=True):
    """The controller heard the rank's hello. The rank waits for it before its set-up: a hello still queued in
    the rank's socket when the rank is killed is lost, and the death would then be taken for one before the
    rank reached outlast's set-up, and charged to max_failures."""

    attempt: int
    rank: int


class SetUp(Msg, frozen=True):
    """The rank's set-up is done (its backend's process group met): what fails from now on is the train
    function's; what failed before was outlast's own set-up (outlast/controller/setup_failures.py)."""

    attempt: int
    rank: int


class SetUpHeard(Msg, frozen=True):
    """The controller heard the rank's `SetUp`. The rank waits for it before its train function runs, for
    the reason it waits for `Welcome`: a `SetUp` still queued when a rank dies right away would be lost, and
    the train function's failure taken for outlast's set-up's."""

    attempt: int
    rank: int


MAX_DATA_POSITION_BYTES = 64 * 1024  # train/data_position.py writes no more


class Report(Msg, frozen=True):
    attempt: int
    rank: int
    index: int
    metrics: dict[str, Any]
    checkpoint_dir: str | None = None  # set by a rank that has files for this checkpoint
    files: list[FileEntry] = []
    upload_pending: bool = False  # the files follow in an UploadDone (asynchronous upload)
    # An asynchronous upload's files as the rank knew them when it began (paths and sizes, no checksums;
    # none for a staged save, which writes them later): what the controller looks for in storage when
    # the rank exits before its UploadDone arrives.
    upload_files: list[FileEntry] = []
    saw_preemption: bool = False  # get_preemption_info() had returned the notice on this rank
    upload_bytes: int = 0  # this rank's checkpoint bytes (a staged save's are known only once written)
    upload_bandwidth_bps: float = 0.0  # measured on this rank's previous upload; 0 when none was
    local_dir: str = ""  # the files on the rank's node until the commit: its memory tier copies them from there
    # local_dir is the checkpoint's own directory in storage (a file system the node sees), which outlives
    # report(): the commit does not wait for the node's copy from it.
    local_dir_stored: bool = False
    in_memory: bool = False  # not uploaded: the files are in local_dir only (a notice's checkpoint through a peer)
    # Seconds this rank spent in its previous report() call, when that call had a checkpoint (0 when it had none):
    # a call's own length is known only once it returns, after its message is sent.
    stalled_s: float = 0.0
    # Where the rank is in its data (train/data_position.py's document; "" when it reads none through outlast):
    # a checkpoint's manifest keeps every rank's, so that a restore goes on at the next batch.
    data_position: str = ""
    # The live group's generation the rank reported in (live recovery; 0 without it): a rank that a shrink left
    # out has no part in a report made in the shrink's generation or after it.
    generation: int = 0

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir)
        if self.generation < 0:
            raise ValueError(f"generation is {self.generation}, below 0")
        if len(self.data_position) > MAX_DATA_POSITION_BYTES:
            raise ValueError(f"data_position is {len(self.data_position)} bytes, over {MAX_DATA_POSITION_BYTES}")
        paths.check_absolute("local_dir", self.local_dir, empty_ok=True)


class RestoreProgress(Msg, frozen=True):
    """A rank fetching the checkpoint it restores: bytes on disk so far (the driver's progress line)."""

    attempt: int
    rank: int
    checkpoint_dir: str
    fetched_bytes: int
    total_bytes: int
    finished: bool = False


class UploadDone(Msg, frozen=True):
    """An asynchronous upload finished (or gave up); it may overtake its Report."""

    attempt: int
    rank: int
    index: int
    checkpoint_dir: str
    files: list[FileEntry] = []
    error: str | None = None

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir)


class CollectiveRequest(Msg, frozen=True):
    attempt: int
    rank: int
    seq: int
    op: str  # "barrier" | "broadcast" | "allgather"
    payload: bytes | None = None  # rank 0's pickled object for a broadcast; each rank's for an allgather


class PreemptionQuery(Msg, frozen=True):
    """A rank reached its horizon of get_preemption_info() calls."""

    attempt: int
    rank: int
    index: int


class WorkerDone(Msg, frozen=True):
    attempt: int
    rank: int
    reports: int


class CheckpointsQuery(Msg, frozen=True):
    """get_all_reported_checkpoints(): answered once each checkpoint among the rank's first `reports`
    reports is committed or refused, from the controller's history (the run state in storage lags it)."""

    attempt: int
    rank: int
    reports: int


class Progress(Msg, frozen=True):
    """From a rank's watch thread, about once a second: how many times its loop has called into outlast
    (report, get_preemption_info, collectives, heartbeat) so far."""

    attempt: int
    rank: int
    count: int


class StackDump(Msg, frozen=True):
    """A rank's Python stacks, every thread, as faulthandler writes them; `where` is the innermost frame
    of its main thread ("all_reduce (distributed_c10d.py:2806)")."""

    attempt: int
    rank: int
    text: str
    where: str


# ---- controller -> worker -------------------------------------------------------


class Committed(Msg, frozen=True):
    index: int
    checkpoint_dir: str


class CommitFailed(Msg, frozen=True):
    index: int
    reason: str


class KeptCheckpoint(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_dir: str
    seq: int
    metrics: dict[str, Any] = {}


class CheckpointsList(Msg, frozen=True):
    """The run's committed checkpoints still kept, in commit order."""

    checkpoints: list[KeptCheckpoint]


class PreemptionGrant(Msg, frozen=True):
    index: int
    horizon: int
    valid_s: float = float("inf")  # the grant ends at the horizon or after this long, whichever is first


class PreemptionNotice(Msg, frozen=True):
    index: int
    decision_index: int  # get_preemption_info() returns the notice from this call on
    node_ids: list[str]
    ranks: list[int]
    deadline_unix_ms: int | None
    reason: str
    message: str
    node_to_ranks: dict[str, list[int]] = {}
    # The checkpoint saved for it goes to a peer's memory first (not uploaded by the ranks): committed once
    # there, then uploaded to storage from the peer (controller/commits/peer.py).
    through_peer: bool = False


class DumpStacks(Msg, frozen=True):
    """To a rank's watch thread: send every thread's stack (the controller found a hang)."""

    attempt: int


class CollectiveReply(Msg, frozen=True):
    seq: int
    payload: bytes | None = None  # a broadcast's source payload; an allgather's, `gathered_payload`


ALLGATHER = "allgather"


def gathered_payload(by_rank: dict[int, bytes]) -> bytes:
    """An allgather's reply: each surviving rank's payload by rank, passed on unread."""
    return msgspec.msgpack.encode(by_rank)


def read_gathered(payload: bytes) -> dict[int, bytes]:
    return msgspec.msgpack.decode(payload, type=dict[int, bytes])


class CollectiveTimeout(Msg, frozen=True):
    seq: int
    op: str
    missing_ranks: list[int]
    waited_s: float


# ---- the memory tier: a node's tier server (outlast/agent/tier_server.py) -----------------------


class TierCopyInfo(msgspec.Struct, frozen=True, kw_only=True):
    run: str
    checkpoint_dir: str
    rank: int
    seq: int
    nbytes: int
    primary: bool
    committed: bool

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir)


class Transfer(msgspec.Struct, frozen=True, kw_only=True):
    """One copy's bytes between two tier servers, given over the CURVE socket: they go through the server's
    plain data socket, sealed with AES-256-GCM under `key`, fresh for this transfer."""

    data_address: str
    session: bytes
    key: bytes


class TierHold(Msg, frozen=True):
    """Keep a rank's reported files (in `source_dir` on this node) in memory, then a replica on `peer`."""

    run: str
    checkpoint_dir: str
    rank: int
    seq: int
    files: list[FileEntry]
    source_dir: str
    peer_address: str = ""  # the peer's tier server; empty: no replica
    # This node is draining: its copy links the rank's files (on the same file system) instead of copying them.
    link: bool = False

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir)
        paths.check_absolute("source_dir", self.source_dir, empty_ok=True)


class TierPull(Msg, frozen=True):
    """Fetch a copy from the tier server at `from_address` into this node's tier (before a restore here)."""

    run: str
    checkpoint_dir: str
    rank: int
    from_address: str

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir)


class TierUpload(Msg, frozen=True):
    """Upload the held copy of a rank's files to the run's storage (`run` is its URI), into `checkpoint_dir`;
    answered with `TierStored` once the files are there or the upload failed."""

    run: str
    checkpoint_dir: str
    rank: int
    replace: bool = True  # a file already there is replaced (False: the lowest rank's copy of a shared file stays)

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir)


class TierOffer(Msg, frozen=True):
    """A copy follows, as `TierChunk`s then `TierOfferEnd`; answered with `TierStored` at the end."""

    run: str
    checkpoint_dir: str
    rank: int
    seq: int
    files: list[FileEntry]
    primary: bool = False
    transfer: Transfer | None = None  # the answer to a fetch: where and how to ask for its chunks

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir)


class TierChunk(Msg, frozen=True):
    """Bytes of a copy: pushed to a peer (answered with `TierAck`) or the answer to a `TierFetch`."""

    run: str
    checkpoint_dir: str
    rank: int
    path: str  # one of the offer's files
    offset: int
    data: bytes = b""  # empty on the wire: the bytes are the frame after this one, sealed (tier_client.TransferSealer)
    session: bytes = b""  # the transfer's, on the data socket (tier_client.TransferSealer)
    nonce: int = 0  # the sender's count within the transfer: the sealed bytes' nonce

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir)
        paths.check_relative("file", self.path)


class TierAck(Msg, frozen=True):
    """An offer accepted (`path` empty) or a chunk written: the sender may send one more. Also the answer
    to a `TierCommit` and a `TierFree` (rank -1)."""

    run: str
    checkpoint_dir: str
    rank: int
    path: str = ""
    offset: int = 0
    transfer: Transfer | None = None  # an offer accepted: where and how its chunks go

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir, empty_ok=True)
        paths.check_relative("file", self.path, empty_ok=True)


class TierOfferEnd(Msg, frozen=True):
    run: str
    checkpoint_dir: str
    rank: int

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir)


class TierFetch(Msg, frozen=True):
    """Read a held copy: without a path, its record (a `TierOffer`); with one, `length` bytes at `offset` (a
    `TierChunk`). A copy not held is answered with `TierStored(ok=False)` saying so."""

    run: str
    checkpoint_dir: str
    rank: int
    path: str = ""
    offset: int = 0
    length: int = 0
    session: bytes = b""  # a chunk asked on the data socket: the transfer's

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir)
        paths.check_relative("file", self.path, empty_ok=True)


class TierCommit(Msg, frozen=True):
    run: str
    checkpoint_dir: str

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir)


class TierFree(Msg, frozen=True):
    run: str


class TierList(Msg, frozen=True):
    pass


class TierStored(Msg, frozen=True):
    """Where a copy now is: on `node_id`, and on `replica_node` when one was asked and made."""

    run: str
    checkpoint_dir: str
    rank: int
    node_id: str
    ok: bool
    reason: str = ""
    replica_node: str = ""
    replica_reason: str = ""  # why there is no replica, when one was asked
    nbytes: int = 0
    seconds: float = 0.0  # from the request to this answer
    replica_seconds: float = 0.0  # of these, the replica's transfer
    skipped: str = ""  # a pull: why this node's own copy was passed over (it did not match its record)

    def __post_init__(self) -> None:
        paths.check_name("checkpoint", self.checkpoint_dir, empty_ok=True)


class TierHoldings(Msg, frozen=True):
    node_id: str
    budget_bytes: int
    used_bytes: int  # copies held and being written
    copies: list[TierCopyInfo]
    spare_bytes: int = 0  # pages kept for the next copy received; with used_bytes, within budget_bytes


TierRequest = Union[TierHold, TierPull, TierUpload, TierOffer, TierChunk, TierOfferEnd, TierFetch, TierCommit, TierFree, TierList]
TierReply = Union[TierStored, TierHoldings, TierOffer, TierChunk, TierAck]


AgentRequest = Union[Ping, SpawnWorkers, StopWorkers, KillRanks, RunHeartbeat, EndRun, StatusRequest, Shutdown, SpawnTask,
                     DrainNode, RegisterNode, NodeHeartbeat, ListNodes, ReadOutput]
AgentEvent = Union[Pong, WorkerStarted, WorkerExited, StatusReply, ShutdownAck, TaskExited, NodeDraining, DrainAck,
                   SpawnRefused, DrainRefused, NodeList, WorkerOutput, OutputLines]
# What the head sends a member agent over the member's own connection.
HeadToMember = Union[HeartbeatAck, NodeDraining]
WorkerMessage = Union[WorkerHello, SetUp, Report, UploadDone, CollectiveRequest, PreemptionQuery, WorkerDone, RestoreProgress,
                      Progress, StackDump, CheckpointsQuery]
ControllerToWorker = Union[Committed, CommitFailed, CollectiveReply, CollectiveTimeout, PreemptionGrant, PreemptionNotice,
                           DumpStacks, CheckpointsList, Welcome, SetUpHeard]


# ---- node agent <-> its fork server (the zygote) ---------------------------------
# A workload's request (`ForkWorker`, `ForkTask`: its run's credential in `env`, its pickled code in
# `payload`) never passes through the fork server, whose memory every child it forks later inherits:
# the agent writes it to a sealed memfd and passes the fd beside a `ForkChild`, and the child reads
# it after its fork (outlast/agent/fork_request.py).


class ForkWorker(Msg, frozen=True):
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
    threads: int = 0  # its share of the node's CPUs, in math library threads (outlast/threads.py); 0: untouched


class ForkTask(Msg, frozen=True):
    run_id: str
    task_id: str
    controller_address: str
    payload: bytes
    env: dict[str, str]
    cwd: str
    sys_path: list[str]
    node_id: str
    error_file: str
    threads: int = 0  # as ForkWorker's


class ForkChild(Msg, frozen=True):
    """What the fork server needs to fork a workload, report it and reap it, and no secret of its run."""

    kind: Literal["worker", "task"]
    run_id: str
    error_file: str  # written by the child when it fails, read by the server when it reaps it
    attempt: int = 0
    rank: int = -1
    task_id: str = ""
    cgroup_procs: list[str] = []  # the child writes its pid here first thing: its own cgroup leaf
    output_file: str = ""  # the child's stdout and stderr go here (appended), read by the agent


class StopForking(Msg, frozen=True):
    """The agent is stopping: the end of the pipe that follows is an ordinary end."""


class ForkStandby(Msg, frozen=True):
    """Fork a standby of this fork server: a copy of it, its modules imported already, that serves the socket
    whose fd follows (outlast/agent/forkserver.py)."""


class ZygoteReady(Msg, frozen=True):
    preloaded: list[str]
    failed: dict[str, str]  # module -> why it did not import
    # What of CUDA the server touched while preloading ("": nothing). Workers forked from a server
    # that initialized CUDA cannot use a GPU, so the agent says so at once.
    cuda_initialized: str = ""
    cuda_driver_loaded: bool = False  # libcuda is mapped in the server (loading it alone is harmless)
    pid: int = 0  # the server's: a forked standby is its fork server's child, not the agent's


class Forked(Msg, frozen=True):
    run_id: str
    attempt: int
    rank: int
    pid: int
    task_id: str = ""
    output_file: str = ""


class Reaped(Msg, frozen=True):
    run_id: str
    attempt: int
    rank: int
    pid: int
    exit_code: int | None
    signal: int | None
    error: WorkerError | None
    task_id: str = ""


ToZygote = Union[ForkChild, StopForking, ForkStandby]
ToChild = Union[ForkWorker, ForkTask]  # read by the child from its memfd
FromZygote = Union[ZygoteReady, Forked, Reaped]
