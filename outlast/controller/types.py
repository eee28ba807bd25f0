"""The controller's typed state: what a run is made of, what an attempt has seen so far."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from outlast.controller.resize import Elastic
from outlast.controller.runstate import RunBook
from outlast.protocol import messages as m
from outlast.storage.records import FailureRecord

if TYPE_CHECKING:
    from outlast.controller.driver_lease import LeaseKeeper
    from outlast.controller.preemption import Preemption


@dataclass(frozen=True)
class Timeouts:
    heartbeat_interval_s: float = 0.5
    driver_lost_after_s: float = 5.0  # the agent kills this run's workers after this silence
    worker_start_s: float = 300.0  # fork, imports, backend set-up
    teardown_grace_s: float = 2.0  # SIGTERM, then SIGKILL after this
    last_messages_s: float = 2.0  # wait for a finished rank's last messages
    collective_warn_s: float = 60.0
    collective_timeout_s: float = 1800.0
    capacity_s: float = 600.0  # how long an attempt waits for a node that takes its workers
    node_lost_after_s: float = 5.0  # a node whose agent is silent this long is lost with its workers


@dataclass(frozen=True)
class RunPlan:
    name: str
    book: RunBook
    world_size: int  # the current attempt's: an elastic run's plan is replaced with each size
    workers: list[m.WorkerSpec]
    payload: bytes
    max_failures: int
    num_to_keep: int | None
    score_attribute: str | None
    score_order: str
    env: dict[str, str]
    cwd: str
    sys_path: list[str]
    rendezvous: bool = False  # the backend meets at rank 0's node (MASTER_ADDR); rank 0 picks the port there
    timeouts: Timeouts = Timeouts()
    lease: "LeaseKeeper | None" = None
    max_preemption_failures: int = -1
    preemption_grace_s: float = 0.0
    relax_collectives: bool = False  # on a preemption, go on with the surviving ranks
    per_worker: dict[str, float] = field(default_factory=dict)
    strategy: str = "PACK"
    forward_output: bool = True  # the workers' output lines come to the driver
    duplicate_files: str = "keep_rank0"  # file_merge.DuplicateFiles: ranks writing one file differently
    elastic: Elastic | None = None  # ScalingConfig(num_workers=(min, max)): world_size starts at max
    hang_timeout_s: float | None = None  # FailureConfig.hang_timeout_s: None adapts (hangs.py); inf never
    checkpoint_storage: str = "storage"  # CheckpointConfig.checkpoint_storage: "storage" or "memory" (commits/holds.py)
    live_recovery: bool = False  # FailureConfig.live_recovery: a rank's death is answered by a replacement (live.py)
    live_store: str = ""  # "host:port" of the store the controller holds for the live groups (runtime.py hosts it)


@dataclass
class AttemptState:
    """What one attempt has seen so far; what it waits for is in the controller's state."""

    number: int
    started_at: float
    hello: set[int] = field(default_factory=set)
    set_up: set[int] = field(default_factory=set)  # ranks whose backend is set up (SetUp): their failures are their own
    exited: dict[int, m.WorkerExited] = field(default_factory=dict)
    failures: list[FailureRecord] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    restore: str | None = None  # the checkpoint this attempt restores
    restore_ranks: set[int] | None = None  # the ranks with files in it, as its manifest says
    prepared: bool = False  # storage has said what it restores: it may be placed
    placement: dict[int, str] = field(default_factory=dict)  # rank -> node id
    specs: dict[int, m.WorkerSpec] = field(default_factory=dict)  # rank -> what it was spawned as (a replacement too)
    env: dict[str, str] = field(default_factory=dict)  # the environment its ranks were spawned with
    pids: dict[int, int] = field(default_factory=dict)  # rank -> its process, as its agent reported it
    lost: set[int] = field(default_factory=set)  # ranks gone with a preempted node, the run going on without them
    # The attempt's preemption, kept once the state that held it is left (an interrupt, a lost lease, a
    # restart): a rank that asks then is still answered with its notice.
    preemption: "Preemption | None" = None
    failed: bool = False  # a failure ended it (not a preemption's restart, whose teardown may fail too)
    checkpoint_queries: dict[int, int] = field(default_factory=dict)  # rank -> its reports, until answered
    stopped_at: float | None = None  # when its workers were first told to stop (SIGTERM, SIGKILL after the grace)
    # Live recovery: rank -> which of its processes sent the message stepped last, where answers go (a drained
    # rank and its replacement live side by side for a while, each asking and answered in turn).
    reply_to: dict[int, int] = field(default_factory=dict)
    # Live recovery: (rank, report index) -> the process that made that report, which a commit's answer goes to (the
    # drained rank in a synchronous report() of it, though its replacement spoke since).
    reported_by: dict[tuple[int, int], int] = field(default_factory=dict)
    # Live recovery: (rank, node) of the drained processes that a move replaced: their exit is no rank's.
    retiring: set[tuple[int, str]] = field(default_factory=set)

    def ranks_on(self, node_ids: Collection[str]) -> list[int]:
        return sorted(r for r, n in self.placement.items() if n in node_ids)

    def all_exited(self, world_size: int) -> bool:
        return len(self.exited) == world_size
