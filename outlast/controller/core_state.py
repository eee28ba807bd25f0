"""The controller core's explicit state, and what every handler uses to say what to do.

`core.ControllerCore` adds the one entry point (`step`) over it. The handlers (`handlers.py`,
`on_workers.py`, `lifecycle.py`, `ending.py`, `memory_restore.py`, `preempt_steps.py`,
`hang_steps.py`, `commit_steps.py`) are plain functions over this state; the commit machine
(`commits/`) has a state of its own, `commits`, and sees this one only as the frozen view
`commit_view()` makes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from outlast.controller import effects as fx
from outlast.controller import states as st
from outlast.controller.collectives import CollectiveTracker
from outlast.controller.commit import CommitTracker
from outlast.controller.commits import Commits, NodeFacts, View
from outlast.controller.group import Effect, Spawn, ToRank
from outlast.controller.hangs import HangWatch
from outlast.controller.live import LiveRun
from outlast.controller.horizons import HorizonBook
from outlast.controller.nodes import NodeBook
from outlast.controller.resize import Resizes
from outlast.controller.retention import RetentionRule
from outlast.controller.types import AttemptState, RunPlan
from outlast.controller.upload_estimate import UploadEstimate
from outlast.errors import TrainingFailedError
from outlast.protocol import messages as m
from outlast.storage.records import FailureRecord

log = logging.getLogger("outlast.controller")


@dataclass(frozen=True)
class RestoreRead:
    """What a new attempt restores, asked of storage (`ReadManifests`) while the history's latest was `asked`."""

    attempt: AttemptState
    asked: str | None


@dataclass(eq=False)
class Restoring:
    """The pulls of a checkpoint kept in memory to the nodes of a new attempt; its ranks start once all answered."""

    attempt: AttemptState
    checkpoint_dir: str
    spawns: list[Spawn]  # the attempt's Spawn effects, held back until then
    left: set[int]  # the pulls not answered yet
    then: str  # where a rank's files come from when no pull brings them


@dataclass(frozen=True)
class Pull:
    """One node pulling one rank's files (`TierPull`) from the first of `sources`; `tried`: those asked already."""

    restoring: Restoring
    number: int
    node: str
    rank: int
    sources: tuple[str, ...]
    tried: frozenset[str]


class CoreState:
    def __init__(self, plan: RunPlan, run_id: str, address: str, wall: Callable[[], float]) -> None:
        self.plan = plan
        self.run_id = run_id
        self.address = address  # where workers reach the controller
        self.wall = wall
        self.book = plan.book  # the run's history, in memory; written through WriteRunState effects
        self.run_key = self.book.store.storage.uri(self.book.store.run_dir)  # the run as tiers and restores name it
        self.state: st.AnyState = st.Initializing()
        self.nodes = NodeBook(plan.timeouts.node_lost_after_s)
        self.attempt: AttemptState | None = None
        self.commit_tracker = CommitTracker(plan.world_size)  # the attempt's reports, until each checkpoint settles
        self.collectives = self.new_collectives()
        self.horizons = HorizonBook()
        self.uploads = UploadEstimate()  # the attempt's checkpoint uploads in flight
        self.resizes = Resizes(plan.elastic)
        self.retention = RetentionRule(plan.num_to_keep, plan.score_attribute, plan.score_order)
        self.hangs: HangWatch | None = None
        self.live: LiveRun | None = None  # the attempt's live group, with FailureConfig(live_recovery=True)
        self.last_metrics: dict[str, Any] | None = None
        self.failures: list[FailureRecord] = []
        self.error: TrainingFailedError | None = None
        self.closing = False  # the run is over; waiting for storage to answer what it was given
        self.closed = False
        self.ids = fx.EffectIds()
        self.commits = Commits(self.ids)  # settled checkpoints on their way to a manifest (commits/)
        self.storage: dict[int, fx.StorageEffect] = {}  # asked of storage, not yet answered
        self.storage_slow: fx.StorageSlow | None = None  # the call storage has been slow on, while it goes on
        self.restore_reads: dict[int, RestoreRead] = {}  # what new attempts restore, asked of storage
        self.pulls: dict[int, Pull] = {}  # restores' copies asked of nodes' tiers, not yet answered
        self.rank_files: dict[str, dict[int, list[str]]] = {}  # checkpoint -> rank -> its files' names, in memory
        self.written_latest = plan.book.state.latest_checkpoint  # as the last run state handed to storage named it
        self.out: list[Effect | fx.StorageEffect | fx.TierAsk] = []
        self.now = 0.0
        self.next_heartbeat = float("-inf")
        self.next_query = float("-inf")
        self.next_node_check = float("-inf")

    def go(self, event: st.Event, new: st.AnyState) -> None:
        """Move to `new`, which must be the state the table gives for this event."""
        expected = st.transition(self.state.kind, event)
        if expected is not new.kind:
            raise st.InvalidTransition(f"{self.state.kind.value} on {event.value} leads to {expected.value}, "
                                       f"not {new.kind.value}")
        log.debug("%s --%s--> %s", self.state.kind.value, event.value, new.kind.value)
        self.state = new
        p = getattr(new, "preemption", None)
        if p is not None and self.attempt is not None:
            self.attempt.preemption = p

    def ask_storage(self, make: Callable[[int], fx.StorageEffect]) -> int:
        """Hand storage an effect, carried out after every earlier one."""
        effect_id = self.ids.take()
        effect = make(effect_id)
        self.storage[effect_id] = effect
        self.out.append(effect)
        return effect_id

    def ask_tier(self, node_id: str, address: str, msg: m.Msg, pull: Pull, timeout_s: float) -> None:
        """Ask a node's memory tier for a restore's copy."""
        effect_id = self.ids.take()
        self.out.append(fx.TierAsk(effect_id, node_id, address, msg, timeout_s))
        self.pulls[effect_id] = pull

    def send_to_rank(self, rank: int, msg: m.Msg, attempt: int | None = None, report: int | None = None) -> None:
        """To the rank's process whose message was stepped last; an answer to report `report`, to the process
        that made it."""
        number = attempt if attempt is not None else self.attempt.number if self.attempt is not None else None
        assert number is not None
        a = self.attempt
        if a is None or a.number != number:
            incarnation = 0
        elif report is not None:
            incarnation = a.reported_by.pop((rank, report), 0)
        else:
            incarnation = a.reply_to.get(rank, 0)
        self.out.append(ToRank(number, rank, msg, incarnation=incarnation))

    def write_state(self) -> None:
        """The history changed: hand storage the new state (before any effect that relies on it)."""
        data = self.book.take_snapshot()
        if data is not None:
            latest = self.book.state.latest_checkpoint
            names_commit, self.written_latest = latest != self.written_latest, latest
            self.ask_storage(lambda i: fx.WriteRunState(i, data, names_commit=names_commit and latest is not None))

    def new_collectives(self) -> CollectiveTracker:
        t = self.plan.timeouts
        return CollectiveTracker(self.plan.world_size, t.collective_warn_s, t.collective_timeout_s)

    def commit_view(self) -> View:
        """What the commit machine sees of the run now."""
        a = self.attempt
        nodes = {n.node_id: NodeFacts(n.node_id, n.tier_address, self.nodes.tier_of(n.node_id), n.failure_domain,
                                      n.state == "draining", self.nodes.reachable(n.node_id))
                 for n in self.nodes.nodes.values()}
        return View(attempt=a.number if a is not None else None, placement=dict(a.placement) if a is not None else {},
                    nodes=nodes, level=self.plan.checkpoint_storage, duplicate_files=self.plan.duplicate_files,
                    records=tuple(self.book.state.checkpoints), run_key=self.run_key,
                    head_lost=self.nodes.head_lost(self.now), wall=self.wall())
