"""A fleet's months, one run: its interruptions struck on time, its history written as the controller writes it,
and its goodput split by the same function as a real run's (`outlast.storage.goodput.split`).

The level: one event per interruption, not one per rank per step. Between interruptions the run's steps are laid
down in bulk, one report per step (with its checkpoint stall) and one checkpoint per interval, each committed once
its copy is made. At an interruption the real decisions are asked: `controller.attempt_verdict.judge_attempt`
(restart or raise, and which budget the attempt is charged to), `controller.preemption.Preemption` (what a drain's
notice covers and when it must be gone), `controller.hangs.HangWatch` (when a hang is found), and
`controller.types.Timeouts` (when a silent node is lost), and with live recovery `controller.live.LiveRun` (whether
a death is answered by replacing the rank, or by a restart). What the run does then (how long a restart, a restore, a
copy take) is a model with its parameters in `FleetConfig`, written out in docs/guide/fleet.md.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any

from outlast.controller.attempt_verdict import AttemptFacts, FailAttempt, judge_attempt
from outlast.controller.hangs import HangWatch
from outlast.controller.live import FallBack, LiveRun, Planned, Replace, Shrunk
from outlast.controller.preemption import Preemption
from outlast.controller.types import Timeouts
from outlast.protocol import messages as m
from outlast.protocol.kinds import Budget, FailureKind
from outlast.protocol.membership import member_name
from outlast.sim.interruptions import SECONDS_PER_DAY, Effect, Interruption
from outlast.storage.goodput import Goodput, split
from outlast.storage.records import (
    AttemptRecord, CheckpointRecord, DrainRecord, FailureRecord, HangRecord, LiveRecoveryRecord, ReportEntry,
    ResizeRecord, RunState,
)

WALL0 = 1_800_000_000.0
NO_METRICS: dict[str, Any] = {}
# bench/results/live-recovery-fit.json: from a kill to the replacement's first step 0.187 s (median of 20), against
# 0.254 s from a kill to a restarted attempt's first step. The fleet's live recovery is its restart scaled so.
LIVE_OVER_RESTART = 0.187 / 0.254


@dataclass(frozen=True)
class FleetConfig:
    nodes: int = 2048
    ranks_per_node: int = 8
    days: float = 54.0
    step_s: float = 6.0  # one optimizer step at full size (405B at 16M tokens a step on 16,384 H100s: about 6 s)
    checkpoint_gb_per_rank: float = 0.4  # 405B's training state at 16 bytes a parameter, over 16,384 ranks
    storage_gb_s: float = 2000.0  # the storage's aggregate bandwidth (Llama 3's Tectonic: 2 TB/s sustained)
    network_gb_s: float = 50.0  # one node's network bandwidth to a peer (400 Gb/s)
    host_copy_gb_s: float = 25.0  # device to host memory, per rank: the checkpoint stall of a step
    checkpoint_every_s: float = 1800.0  # a checkpoint to storage
    memory_every_s: float = 300.0  # with the memory tier: a checkpoint in memory, copied to a peer node
    startup_s: float = 300.0  # the first attempt: scheduling, images, imports, to the first step
    restart_s: float = 90.0  # a later attempt, restore aside: teardown, spawn, imports, the group's set-up
    live_recover_s: float = 90.0 * LIVE_OVER_RESTART  # live recovery: a death to the replacement's first step
    new_node_s: float = 0.0  # more, when a node takes a lost one's place (its agent started; a warm spare: none)
    notice_s: float = 120.0  # a drain's notice (a cloud's preemption notice: 30 s to 2 min)
    replace_s: float = 1800.0  # without a spare: until the scheduler gives the run another node
    repair_s: float = 86_400.0  # a lost node back in the spare pool
    spares: int = 16  # spare nodes, with spares on
    hang_timeout_s: float | None = None  # FailureConfig.hang_timeout_s: None adapts to the run's steps
    timeouts: Timeouts = Timeouts()


@dataclass(frozen=True)
class Mechanisms:
    memory_tier: bool = True
    jit_drain: bool = True  # a checkpoint at a drain's notice
    spares: bool = True
    elastic: bool = True  # shrink, rather than wait, when no node replaces a lost one
    live_recovery: bool = True  # replace a dead rank and go on, where `LiveRun` says so

    def label(self) -> str:
        off = [k for k, v in vars(self).items() if not v]
        return "all on" if not off else "all off" if len(off) == len(vars(self)) else "off: " + ", ".join(off)


@dataclass
class FleetRun:
    state: RunState
    reports: dict[int, list[ReportEntry]]
    goodput: Goodput
    budgets: dict[str, int]  # what the verdicts charged, per budget
    struck: dict[str, int]  # interruptions per effect that struck the run
    progress: int  # the run's progress at its end: reports that stay, counted through restores
    restores: dict[str, int]  # from memory, from storage, from nothing
    live: dict[str, int]  # deaths live recovery answered ("live"), and those it left to a restart ("restart")
    node_seconds_short: float  # node-seconds the run ran smaller than asked (elastic)
    decisions_s: float  # CPU in the real decisions (verdicts, preemptions, hang limits)


@dataclass
class _Ckpt:
    record: CheckpointRecord
    progress: int  # the run's progress once restored


@dataclass
class _Attempt:
    number: int
    start: float
    first: float  # its first report
    nodes: int
    restored: _Ckpt | None
    base: int  # progress it restored
    record: AttemptRecord
    reports: list[ReportEntry] = field(default_factory=list)
    last_t: float = 0.0  # its newest report's time (or its start)
    live: LiveRun | None = None  # its generations, with live recovery on
    resume: float = 0.0  # after a live recovery: when the replacement holds the state and the next step begins
    replay_until: int = 0  # the run's progress before it began: its steps up to there are trained again


def simulate(config: FleetConfig, mech: Mechanisms, events: list[Interruption]) -> FleetRun:
    return _Fleet(config, mech).run(events)


class _Fleet:
    def __init__(self, c: FleetConfig, mech: Mechanisms) -> None:
        self.c, self.mech = c, mech
        self.end = c.days * SECONDS_PER_DAY
        gb_node = c.checkpoint_gb_per_rank * c.ranks_per_node
        self.stall_s = c.checkpoint_gb_per_rank / c.host_copy_gb_s
        self.to_peer_s = gb_node / c.network_gb_s  # a node's shards to (or from) a peer's memory
        self.to_storage_s = max(gb_node * c.nodes / c.storage_gb_s, gb_node / c.network_gb_s)
        every = c.memory_every_s if mech.memory_tier else c.checkpoint_every_s
        self.ckpt_steps = max(1, round(every / c.step_s))
        self.durable_steps = max(self.ckpt_steps, round(c.checkpoint_every_s / c.step_s) // self.ckpt_steps
                                 * self.ckpt_steps)
        # Nodes beyond the run's: when each can be taken (spares at once; without spares, none until asked).
        self.pool: list[float] = [0.0] * c.spares if mech.spares else []
        self.missing = 0  # nodes the run runs without (elastic)
        self.state = RunState(name="fleet", status="running", created_at=WALL0, updated_at=WALL0)
        self.reports: dict[int, list[ReportEntry]] = {}
        self.ckpts: list[_Ckpt] = []
        self.budgets: dict[str, int] = {}
        self.struck: dict[str, int] = {}
        self.restores = {"memory": 0, "storage": 0, "none": 0}
        self.live = {"live": 0, "restart": 0}
        self.short_s = 0.0
        self.decisions_s = 0.0
        self.history: list[FailureRecord] = []
        self.reached = 0

    # ---- the run ------------------------------------------------------------------------

    def run(self, events: list[Interruption]) -> FleetRun:
        a = self._begin(1, 0.0, None, waited_until=0.0)
        for ev in events:
            if ev.at_s >= self.end:
                break
            at = max(ev.at_s, a.start, a.resume)  # one that strikes during a live recovery: at its end
            a = self._grow_if_due(a, at)
            a = self._strike(a, replace(ev, at_s=at))
        a = self._grow_if_due(a, self.end)
        self._lay_steps(a, self.end)
        self._close(a, self.end, "finished")
        self.state.status = "finished"
        g = split(self.state, self.reports, WALL0 + self.end)
        return FleetRun(self.state, self.reports, g, self.budgets, self.struck, self.reached, self.restores,
                        self.live, self.short_s, self.decisions_s)

    def _begin(self, number: int, at: float, restored: _Ckpt | None, waited_until: float,
               replaced_node: bool = False, restart_s: float | None = None) -> _Attempt:
        c = self.c
        nodes = c.nodes - self.missing
        if restored is None:
            restore_s = 0.0
            self.restores["none"] += number > 1
        elif self.mech.memory_tier:
            # In memory (a durable checkpoint is kept there too): each node reads its own shards back; a replaced node pulls its shards from a peer.
            restore_s = max(self.stall_s, self.to_peer_s if replaced_node else 0.0)
            self.restores["memory"] += 1
        else:
            restore_s = self.to_storage_s
            self.restores["storage"] += 1
        if number == 1:
            restart = c.startup_s
        elif restart_s is not None:
            restart = restart_s
        else:
            restart = c.restart_s + (c.new_node_s if replaced_node else 0.0)
        ready = max(at, waited_until) + restart + restore_s
        rec = AttemptRecord(attempt=number, started_at=WALL0 + at,
                            restored_from=restored.record.checkpoint_dir if restored else None,
                            workers=nodes * c.ranks_per_node)
        if waited_until > at:
            rec.waiting_since, rec.capacity_at = WALL0 + at, WALL0 + waited_until
        self.state.attempts.append(rec)
        self.reports[number] = []
        base = restored.progress if restored else 0
        a = _Attempt(number, at, ready, nodes, restored, base, rec, self.reports[number], last_t=at,
                     replay_until=self.reached)
        if self.mech.live_recovery:
            began = time.process_time()
            a.live = LiveRun(nodes * c.ranks_per_node)
            self.decisions_s += time.process_time() - began
        return a

    def _step_s(self, a: _Attempt) -> float:
        # The same global batch on fewer nodes: a step takes longer by the nodes missing.
        return self.c.step_s * self.c.nodes / a.nodes

    def _lay_steps(self, a: _Attempt, until: float, stop_at_checkpoint: bool = False) -> _Ckpt | None:
        """Reports from the attempt's newest one to `until`; with `stop_at_checkpoint`, up to the first checkpoint
        (returned, and committed) whose report falls before `until`."""
        step = self._step_s(a)
        t = max(a.reports[-1].time - WALL0 if a.reports else a.first - step, a.resume)
        i = len(a.reports)
        out = a.reports
        while True:
            ckpt = (i + 1) % self.ckpt_steps == 0
            stall = self.stall_s if ckpt else 0.0
            nt = t + step + stall
            if nt > until:
                break
            out.append(ReportEntry(index=i, time=WALL0 + nt, metrics=NO_METRICS, stalled_s=stall))
            if ckpt:
                k = self._commit(a, i, nt)
                if stop_at_checkpoint:
                    return k
            t, i = nt, i + 1
        if a.nodes < self.c.nodes:
            self.short_s += (self.c.nodes - a.nodes) * (min(until, self.end) - max(a.last_t, a.start))
        a.last_t = until
        self.reached = max(self.reached, a.base + len(out))
        return None

    def _commit(self, a: _Attempt, index: int, at: float) -> _Ckpt:
        durable = not self.mech.memory_tier or (index + 1) % self.durable_steps == 0
        copy_s = self.to_storage_s if durable else self.to_peer_s
        name = f"checkpoint_{a.number:03d}_{index:06d}"
        rec = CheckpointRecord(checkpoint_dir=name, seq=len(self.ckpts), attempt=a.number, report_index=index,
                               committed_at=WALL0 + at + copy_s, durable=durable,
                               memory=[] if durable and not self.mech.memory_tier else ["peer"])
        k = _Ckpt(rec, a.base + index + 1)
        self.ckpts.append(k)
        self.state.checkpoints.append(rec)
        return k

    def _newest(self, at: float) -> _Ckpt | None:
        """The newest checkpoint committed by `at` (a memory one has its copy on a peer: one lost node keeps it)."""
        for k in reversed(self.ckpts):
            if k.record.committed_at <= WALL0 + at:
                return k
        return None

    # ---- interruptions ----------------------------------------------------------------------

    def _strike(self, a: _Attempt, ev: Interruption) -> _Attempt:
        c = self.c
        self.struck[ev.effect.value] = self.struck.get(ev.effect.value, 0) + 1
        node_id = f"n{ev.node}"
        ranks = self._ranks_on(a, ev.node)
        rank = ranks[0]
        preemption = None
        hang = None
        node_gone = ev.effect in (Effect.NODE_LOST, Effect.DRAIN)
        if ev.effect is Effect.DRAIN:
            end, preemption, restore_from = self._drain(a, ev, node_id, rank)
        else:
            if ev.effect is Effect.HANG:
                self._lay_steps(a, ev.at_s)
                end = self._hang_found(a)
                hang = HangRecord(attempt=a.number, time=WALL0 + end, summary=ev.cause)
                self.state.hangs.append(hang)
            elif ev.effect is Effect.NODE_LOST:
                self._lay_steps(a, ev.at_s)
                end = ev.at_s + c.timeouts.node_lost_after_s
                # The node's ranks are replaced on a node with room: a spare free when the loss is seen.
                room = bool(self.pool) and self.pool[0] <= end
                answered = self._live(a, ev, ranks, node_id, end, room=room) if a.live is not None else None
                if answered is not None:
                    self._lost_node(end)  # the lost node goes to repair...
                    if isinstance(answered, Replace):
                        heapq.heappop(self.pool)  # ...and the spare its ranks went to is taken
                    return a
            else:
                self._lay_steps(a, ev.at_s)
                end = ev.at_s
                if a.live is not None and self._live(a, ev, ranks[:1], node_id, end) is not None:
                    return a
            restore_from = self._newest(end)
        failure = self._failure(a, ev, rank, node_id, end)
        self._judge(a, [failure] if failure else [], preemption, ev)
        self._close(a, end, "failed")
        return self._next(a.number + 1, end, restore_from, node_gone, ev.restart_s)

    def _drain(self, a: _Attempt, ev: Interruption, node_id: str, rank: int
               ) -> tuple[float, Preemption, _Ckpt | None]:
        c = self.c
        began = time.process_time()
        notice = m.NodeDraining(node_id=node_id, reason="maintenance", message=ev.cause,
                                deadline_unix_s=WALL0 + ev.at_s + c.notice_s)
        ranks = {r: node_id for r in range(rank, rank + c.ranks_per_node)}
        p = Preemption.begin(notice, ranks, [node_id], [len(a.reports)] * c.ranks_per_node, now=ev.at_s,
                             wall=WALL0 + ev.at_s, grace_s=0.0)
        self.decisions_s += time.process_time() - began
        deadline = p.deadline
        self.state.drains.append(DrainRecord(attempt=a.number, node_ids=[node_id], reason="maintenance",
                                             message=ev.cause, time=WALL0 + ev.at_s, deadline=WALL0 + deadline,
                                             ranks=sorted(ranks)))
        self._lay_steps(a, ev.at_s)
        if self.mech.jit_drain:
            # Every rank saves at its next step's end; the run goes once the checkpoint has its copy.
            step = self._step_s(a)
            t = max(a.reports[-1].time - WALL0 if a.reports else max(a.first - step, ev.at_s), a.resume)
            at = max(t, ev.at_s) + step + self.stall_s
            i = len(a.reports)
            if at <= deadline and a.first <= ev.at_s + step:
                a.reports.append(ReportEntry(index=i, time=WALL0 + at, metrics=NO_METRICS, stalled_s=self.stall_s))
                k = self._commit(a, i, at)
                self.reached = max(self.reached, a.base + len(a.reports))
                gone = min(deadline, k.record.committed_at - WALL0)
                return gone, p, (k if k.record.committed_at - WALL0 <= deadline else self._newest(gone))
        self._lay_steps(a, deadline)
        return deadline, p, self._newest(deadline)

    def _ranks_on(self, a: _Attempt, node: int) -> list[int]:
        """The ranks of the attempt's node that an interruption of fleet node `node` strikes. With live recovery,
        as the group holds them (a live shrink leaves a node's ranks out and a grow adds a node's after the
        others: the group's ranks stay in whole nodes)."""
        rpn = self.c.ranks_per_node
        i = node % a.nodes
        if a.live is not None:
            return a.live.slots[i * rpn:(i + 1) * rpn]
        return list(range(i * rpn, (i + 1) * rpn))

    def _live(self, a: _Attempt, ev: Interruption, ranks: list[int], node_id: str, at: float,
              room: bool = True) -> Replace | Shrunk | None:
        """Ask the attempt's `LiveRun` about a death of `ranks` (a lost node's, or one rank). Replaced: the
        replacement takes the state, and the step in flight is run again from `live_recover_s` (and the state's
        transfer) on: the survivors keep their part of it, but wait the step's time for the replacement's; the
        death is charged to max_failures as the controller charges it. Shrunk (a lost node with no room, in an
        elastic run): the group goes on without the node from `live_recover_s` on, the step in flight thrown
        away, each step longer by the node missing. Otherwise None: a restart, as without live recovery."""
        assert a.live is not None
        c = self.c
        rank = ranks[0]
        failure = self._failure(a, ev, rank, node_id, at)
        assert failure is not None
        began = time.process_time()
        if ev.at_s >= a.first:
            a.live.on_joined(0, 0, WALL0 + a.first)  # the ranks formed their live group with their first step
        lost = ev.effect is Effect.NODE_LOST
        d: Replace | Shrunk | FallBack
        if lost and not room:
            d = FallBack(f"rank(s) of lost node {node_id} have no room on another node: no spare is free")
            if self.mech.elastic and a.nodes > 1:  # as the controller's `live_steps._shrink`, at min_workers of a node
                d = a.live.on_shrink(ranks, f"shrink: {failure.describe()}", WALL0 + at, c.ranks_per_node, node_id)
        else:  # a lost node's ranks die together: one recovery, one failure
            for r in ranks:
                d = a.live.on_death(r, failure.describe(), WALL0 + at, lost_node=node_id if lost else None)
                if not isinstance(d, Replace):
                    break
        self.decisions_s += time.process_time() - began
        if isinstance(d, FallBack):
            self.live["restart"] += 1
            self.state.live_recoveries.append(LiveRecoveryRecord(
                attempt=a.number, ranks=[rank], cause=failure.describe(), path="restart", time=WALL0 + ev.at_s,
                reason=d.reason))
            return None
        moved = c.checkpoint_gb_per_rank / c.network_gb_s if isinstance(d, Replace) else 0.0
        ready = at + c.live_recover_s + moved
        began = time.process_time()
        # The survivors kept the step in flight, or a shrink threw it away.
        done = a.live.on_joined(d.membership.generation, int(isinstance(d, Shrunk)), WALL0 + ready)
        self.decisions_s += time.process_time() - began
        assert done is not None
        a.record.failures.append(failure)
        self.history.append(failure)
        self.budgets[Budget.WORKER.value] = self.budgets.get(Budget.WORKER.value, 0) + 1
        self.state.failure_counts[Budget.WORKER.value] = self.budgets[Budget.WORKER.value]
        self.state.live_recoveries.append(LiveRecoveryRecord(
            attempt=a.number, ranks=list(done.ranks), cause=done.cause, path="live", time=done.since,
            generation=done.generation, steps_lost=done.steps_lost, seconds=done.seconds, reason=d.reason))
        self.live["live"] += 1
        if isinstance(d, Shrunk):
            self.missing += 1
            self._resize(a, a.nodes - 1, f"shrink, live: node {node_id} lost", 1, at)
        # The next step begins once the replacement holds the state (or the smaller group formed); the split charges
        # the recovery's record, from the last report before the death to `ready`, to live recoveries.
        a.resume = ready
        return d

    def _resize(self, a: _Attempt, nodes: int, reason: str, steps_lost: int, at: float) -> None:
        """A live shrink or grow: the attempt goes on with `nodes` nodes."""
        rpn = self.c.ranks_per_node
        self.state.resizes.append(ResizeRecord(attempt=a.number, from_workers=a.nodes * rpn, to_workers=nodes * rpn,
                                               reason=reason, steps_lost=steps_lost, time=WALL0 + at))
        a.nodes = nodes
        a.record.workers = nodes * rpn

    def _hang_found(self, a: _Attempt) -> float:
        """When the controller finds the hang: HangWatch's limit (adaptive, or the run's own) after the newest
        progress."""
        began = time.process_time()
        fed = a.reports[-64:]
        last = fed[0].time - WALL0 if fed else a.start
        w = HangWatch(attempt=a.number, ranks=1, timeout_s=self.c.hang_timeout_s, started=last)
        for r in fed:
            w.on_progress(0, r.index, r.time - WALL0)
            last = r.time - WALL0
        found = last + w.limit_s() + 1e-3
        assert w.check([0], found) is not None
        self.decisions_s += time.process_time() - began
        return found

    def _failure(self, a: _Attempt, ev: Interruption, rank: int, node_id: str, at: float) -> FailureRecord | None:
        if ev.effect is Effect.DRAIN:
            return None  # the verdict adds the preemption's own record
        kind = {Effect.NODE_LOST: FailureKind.NODE_LOST, Effect.HANG: FailureKind.HANG}.get(ev.effect)
        return FailureRecord(attempt=a.number, rank=rank, node_id=node_id, pid=0,
                             exit_code=1 if kind is None else None, signal=None, time=WALL0 + at, kind=kind,
                             exc_type="RuntimeError" if kind is None else None, message=ev.cause)

    def _judge(self, a: _Attempt, failures: list[FailureRecord], preemption: Preemption | None,
               ev: Interruption) -> None:
        began = time.process_time()
        facts = AttemptFacts(self.state.latest_checkpoint,
                             a.restored.record.checkpoint_dir if a.restored else None,
                             {Budget(k): v for k, v in self.budgets.items()})
        ranks = frozenset(f.rank for f in failures)
        verdict = judge_attempt(facts, a.number, failures, self.history, preemption, max_failures=-1,
                                max_preemption_failures=-1, started=ranks, set_up=ranks)
        self.decisions_s += time.process_time() - began
        if not verdict.retry:
            raise RuntimeError(f"the run gave up at {ev}: {verdict.error}")
        for change in verdict.changes:
            if isinstance(change, FailAttempt):
                self.budgets[change.budget.value] = self.budgets.get(change.budget.value, 0) + 1
                self.state.failure_counts[change.budget.value] = self.budgets[change.budget.value]
        a.record.failures = list(verdict.blamed)
        self.history.extend(verdict.blamed)

    def _close(self, a: _Attempt, at: float, outcome: str) -> None:
        a.record.ended_at = WALL0 + at
        a.record.outcome = outcome
        while self.ckpts and self.ckpts[-1].record.committed_at > WALL0 + at:
            # Not committed when the attempt ended: never written to the history, and gone with the attempt.
            self.ckpts.pop()
            self.state.checkpoints.pop()
        if self.ckpts:
            self.state.latest_checkpoint = self.ckpts[-1].record.checkpoint_dir

    def _next(self, number: int, at: float, restored: _Ckpt | None, node_gone: bool,
              restart_s: float | None) -> _Attempt:
        c = self.c
        waited = at
        replaced = False
        if node_gone:
            self._lost_node(at)
            soonest = self.pool[0] if self.pool else math.inf
            if soonest <= at:
                heapq.heappop(self.pool)
                replaced = True
            elif self.mech.elastic and c.nodes - self.missing > 1:
                self.missing += 1
            elif soonest <= at + c.replace_s:
                heapq.heappop(self.pool)
                waited, replaced = soonest, True
            else:  # the scheduler's node comes before a repaired spare
                waited, replaced = at + c.replace_s, True
        return self._begin(number, at, restored, waited_until=waited, replaced_node=replaced, restart_s=restart_s)

    def _lost_node(self, at: float) -> None:
        """The lost node comes back: repaired into the spare pool, or, without spares, as the scheduler's
        replacement. (With spares, none free, the scheduler's node is taken when it comes before a repaired
        one: `_next`.)"""
        heapq.heappush(self.pool, at + (self.c.repair_s if self.mech.spares else self.c.replace_s))

    def _grow_if_due(self, a: _Attempt, until: float) -> _Attempt:
        """An elastic run smaller than asked grows back at its first checkpoint once a node is free; with live recovery,
        as the node starts (its ranks take the state from the running ones, which train on meanwhile)."""
        while self.missing and self.pool and self.pool[0] < until:
            if a.live is not None:
                t = max(self.pool[0], a.start, a.resume) + self.c.new_node_s
                if t >= until or not self._grow_live(a, t):
                    return a
                continue
            self._lay_steps(a, max(self.pool[0], a.start))
            k = self._lay_steps(a, until, stop_at_checkpoint=True)
            if k is None:
                return a
            at = k.record.committed_at - WALL0
            if at >= until:
                return a
            heapq.heappop(self.pool)
            self.missing -= 1
            self.state.resizes.append(ResizeRecord(attempt=a.number + 1, from_workers=a.nodes * self.c.ranks_per_node,
                                                   to_workers=(a.nodes + 1) * self.c.ranks_per_node,
                                                   reason="a node is free again", steps_lost=0, time=WALL0 + at))
            self._close(a, at, "resized")
            a = self._begin(a.number + 1, at, k, waited_until=at, replaced_node=True)
        return a


    def _grow_live(self, a: _Attempt, t: float) -> bool:
        """A free node's ranks join the attempt's group at `t` (`LiveRun.on_grow`, as `live_steps.on_grow` asks it),
        and take the state from the running ranks: the step that forms the larger group waits for it. False: not
        live (the attempt's ranks have not formed their group yet)."""
        assert a.live is not None
        c = self.c
        began = time.process_time()
        world = len(a.live.slots)
        d = a.live.on_grow(world + c.ranks_per_node, "grow: a node is free again", WALL0 + t)
        if not isinstance(d, Planned):
            self.decisions_s += time.process_time() - began
            return False
        for r in d.ranks:
            a.live.on_started(member_name(r, d.incarnations[r]))
        assert a.live.publishable(told=True) == d.membership
        ready = t + c.checkpoint_gb_per_rank / c.network_gb_s
        done = a.live.on_joined(d.membership.generation, 0, WALL0 + ready)
        self.decisions_s += time.process_time() - began
        assert done is not None
        self._lay_steps(a, t)
        heapq.heappop(self.pool)
        self.missing -= 1
        self.state.live_recoveries.append(LiveRecoveryRecord(
            attempt=a.number, ranks=list(done.ranks), cause=done.cause, path="live", time=done.since,
            generation=done.generation, steps_lost=0, seconds=done.seconds, reason=d.reason))
        self._resize(a, a.nodes + 1, "grow, live: a node is free again", 0, t)
        a.resume = ready
        return True


def goodput_parts(g: Goodput) -> dict[str, float]:
    return {k: round(v, 1) for k, v in g.parts().items()}


def seeded(seed: int) -> random.Random:
    return random.Random(seed)
