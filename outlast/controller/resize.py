"""Elastic runs: how many workers an attempt gets, when a run grows, and how a resize ends an attempt.

A run with `ScalingConfig(num_workers=(min, max))` takes the most workers that fit, from
`max` down to `min`, at every placement. It shrinks by ending the attempt it is in: a node
lost, or drained with nowhere to move, ends the attempt as it always did, and the next
placement takes what is left. It grows by telling the loop: when the node table shows room
for more workers than the attempt has, on nodes that are not draining, and the attempt has
run at least the run's least interval between resizes, the loop gets a notice, saves a
checkpoint, and the attempt ends once it is committed; the next one is larger and loses no
step.

The notice is the preemption notice itself, with reason "resize" and no preempted rank or
node, not a sibling call: the loop that saves on `get_preemption_info()` (the pattern the
guide teaches) grows with no change, and the notice reaches every rank at the same call
without a barrier (`horizons.py`), which is what keeps the saved step the same on every
rank. A loop that must tell the two apart reads `info.reason`. A resize has no deadline: the
attempt ends once the loop saves, never before, so no step is lost; a loop that never saves
keeps training at its size.

Resizes draw on no failure budget: an attempt that ends for a change of capacity alone (a
resize notice, a drain, a node lost with every other failure a symptom of it) is recorded
"resized". A failure of the train function racing a resize is a failure, charged as one.
Pure: times and the node table come in as arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from outlast.controller.placement import NodeView, NoCapacity, Placement, place
from outlast.controller.policy import is_symptom, is_users_error
from outlast.controller.preemption import Preemption, Verdict
from outlast.controller.runstate import RunBook
from outlast.controller.attempt_verdict import AttemptVerdict, EndAttempt
from outlast.controller.upload_estimate import Estimate
from outlast.protocol import messages as m
from outlast.protocol.kinds import FailureKind
from outlast.storage.records import FailureRecord, ResizeRecord

RESIZE = "resize"  # PreemptionInfo.reason of a resize notice


@dataclass(frozen=True)
class Elastic:
    min_workers: int
    max_workers: int
    min_interval_s: float = 60.0  # ScalingConfig.elastic_resize_monitor_interval_s


@dataclass(frozen=True)
class Grow:
    to_workers: int | None  # None: stay at this size
    reason: str


@dataclass
class Resize(Preemption):
    """A preemption of no rank: the attempt ends once the loop has saved, to restart larger."""

    from_workers: int = 0
    to_workers: int = 0

    def decide(self, now: float, saved: str | None, room_elsewhere: bool, uploads: Estimate | None = None) -> Verdict:
        if saved is not None:
            return Verdict(True, f"checkpoint {saved}, saved for the resize from {self.from_workers} to "
                                 f"{self.to_workers} workers, is committed")
        if now >= self.deadline:  # a drain during the resize set a deadline
            passed = super().decide(now, saved, room_elsewhere, uploads).reason.replace("preemption", "drain's", 1)
            return Verdict(True, f"{passed}, during the resize")
        return Verdict(False, f"waiting for the loop to save a checkpoint to grow to {self.to_workers} workers")


@dataclass(frozen=True)
class _Ended:
    from_workers: int
    reason: str
    steps_lost: int


@dataclass
class Resizes:
    """What a run remembers about its size: the range, when the current size began, why the last attempt ended."""

    elastic: Elastic | None
    since: float = -math.inf  # when the current attempt was placed (monotonic)
    ended: _Ended | None = field(default=None)

    def place(self, nodes: list[NodeView], world_size: int, per_worker: dict[str, float],
              strategy: str) -> Placement | NoCapacity:
        """The most workers that fit, from max down to min (a fixed run: exactly `world_size`)."""
        if self.elastic is None:
            return place(nodes, world_size, per_worker, strategy)
        return place_range(nodes, self.elastic.min_workers, self.elastic.max_workers, per_worker, strategy)

    def room_elsewhere(self, nodes: list[NodeView], world_size: int, per_worker: dict[str, float],
                       strategy: str) -> bool:
        return not isinstance(self.place(nodes, world_size, per_worker, strategy), NoCapacity)

    def may_grow(self, current: int) -> bool:
        """Whether the run could grow from `current` workers at all: elastic, and under its largest size."""
        return self.elastic is not None and current < self.elastic.max_workers

    def consider_grow(self, nodes: list[NodeView], current: int, per_worker: dict[str, float], strategy: str,
                      now: float) -> Grow:
        e = self.elastic
        if e is None or current >= e.max_workers:
            return Grow(None, "at its largest size" if e else "not elastic")
        placed = place_range(nodes, current + 1, e.max_workers, per_worker, strategy)
        if isinstance(placed, NoCapacity):
            return Grow(None, f"no room for more than {current} workers")
        to = len(placed.workers)
        if now - self.since < e.min_interval_s:
            return Grow(None, f"room for {to} workers, but this size began {now - self.since:.1f} s ago, under "
                              f"the {e.min_interval_s:g} s between resizes (elastic_resize_monitor_interval_s)")
        return Grow(to, f"room for {to} workers (now {current}) on nodes that are not draining")

    def end_if_resized(self, book: RunBook, attempt: int, world_size: int, failures: list[FailureRecord],
                       preemption: Preemption | None, reports: list[int]) -> AttemptVerdict | None:
        """End the attempt as resized, with no budget charged, if capacity alone ended it; else None. Reads
        `book`, and leaves its change to the verdict."""
        why = self._capacity_change(failures, preemption)
        if why is None:
            return None
        self.ended = _Ended(world_size, why, steps_lost(book, attempt, reports))
        return AttemptVerdict(retry=True, changes=(EndAttempt("resized"),))

    def _capacity_change(self, failures: list[FailureRecord], preemption: Preemption | None) -> str | None:
        if self.elastic is None:
            return None
        if isinstance(preemption, Resize):
            if all(is_symptom(f) for f in failures):
                return f"grow: {preemption.notice.message}"
            preemption = None  # something else ended it: judged as if no resize had begun
        if preemption is not None:
            if any(is_users_error(f) for f in failures):
                return None
            n = preemption.notice
            return f"node {', '.join(preemption.node_ids) or n.node_id} drained ({n.reason}: {n.message})"
        lost = [f for f in failures if f.kind is FailureKind.NODE_LOST]
        if lost and all(f.kind is FailureKind.NODE_LOST or is_symptom(f) for f in failures):
            return f"node {', '.join(sorted({f.node_id for f in lost}))} lost"
        return None

    def placed(self, book: RunBook, attempt: int, workers: int, now: float, wall: float) -> ResizeRecord | None:
        """The attempt has its nodes: note its size, and the resize if its size differs from the last one's."""
        self.since = now
        ended, self.ended = self.ended, None
        attempts = book.state.attempts
        previous = next((a.workers for a in reversed(attempts[:-1]) if a.workers), None)
        record = None
        if previous is not None and previous != workers:
            record = ResizeRecord(attempt=attempt, from_workers=previous, to_workers=workers,
                                  reason=ended.reason if ended else "restarted on what fits",
                                  steps_lost=ended.steps_lost if ended else 0, time=wall)
        book.note_size(workers, record, wall)
        return record


def grow_notice(grow: Grow, current: int, reports: list[int], now: float, wall: float) -> Resize:
    assert grow.to_workers is not None
    message = f"growing from {current} to {grow.to_workers} workers: {grow.reason}"
    notice = m.NodeDraining(node_id="", reason=RESIZE, message=message, deadline_unix_s=None, node_ids=[])
    return Resize(notice=notice, ranks=[], node_ids=[], noticed_at=wall, deadline=math.inf,
                  reports_at_notice=list(reports), from_workers=current, to_workers=grow.to_workers)


def for_judging(preemption: Preemption | None) -> Preemption | None:
    """A resize that a failure raced is no preemption: the failure is charged as one."""
    return None if isinstance(preemption, Resize) else preemption


def place_range(nodes: list[NodeView], low: int, high: int, per_worker: dict[str, float],
                strategy: str) -> Placement | NoCapacity:
    """The largest size in [low, high] that fits. Whether n workers fit only gets harder as n grows, for
    every strategy, so a bisection finds it in log(high - low) placements."""
    best = place(nodes, low, per_worker, strategy)
    if isinstance(best, NoCapacity):
        return NoCapacity(f"not even the run's minimum of {low} workers fits: {best.reason}") if low < high else best
    lo, hi = low, high  # lo fits; find the largest that does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        placed = place(nodes, mid, per_worker, strategy)
        if isinstance(placed, NoCapacity):
            hi = mid - 1
        else:
            lo, best = mid, placed
    return best


def steps_lost(book: RunBook, attempt: int, reports: list[int]) -> int:
    """Reports the attempt made after its newest committed checkpoint (all of them, if it committed none)."""
    made = max(reports, default=0)
    mine = [c for c in book.state.checkpoints if c.attempt == attempt]
    if not mine:
        return made
    newest = max(mine, key=lambda c: c.report_index)
    return max(0, made - (newest.report_index + 1))
