"""What the controller's core does about hangs (`hangs.py` decides): watch each rank's progress, ask every
rank for its stacks once one is stuck, and end the attempt as a failure once they are in.

Plain functions over the core's state (`core_state.CoreState`), as `handlers.py` has.
"""

from __future__ import annotations

import logging

from outlast.controller import lifecycle, live_steps
from outlast.controller.core_state import CoreState
from outlast.controller.group import ToRank
from outlast.controller.hangs import HangWatch
from outlast.controller.states import State
from outlast.controller.types import AttemptState
from outlast.protocol import messages as m
from outlast.protocol.kinds import FailureKind
from outlast.storage.records import FailureRecord

log = logging.getLogger("outlast.controller")

_WATCHED = (State.RUNNING, State.PREEMPTING, State.SAVED)



def hang_watch(c: CoreState, a: AttemptState, now: float) -> HangWatch:
    w = c.hangs
    if w is None or w.attempt != a.number:
        w = c.hangs = HangWatch(a.number, c.plan.world_size, c.plan.hang_timeout_s, now)
    return w


def on_watch_message(c: CoreState, msg: m.Progress | m.StackDump) -> None:
    a = c.attempt
    assert a is not None
    w = hang_watch(c, a, c.now)
    if isinstance(msg, m.Progress):
        w.on_progress(msg.rank, msg.count, c.now)
        return
    w.on_dump(msg)
    end_hung_attempt(c, a, w)


def check_hangs(c: CoreState, a: AttemptState, now: float) -> None:
    if c.state.kind not in _WATCHED:
        return
    w = hang_watch(c, a, now)
    if w.hang is None and now < w.calm_until:  # called at every step: no hang can be found, none is being explained
        return
    live = [r for r in range(c.plan.world_size) if r not in a.exited]
    hang = w.check(live, now)
    if hang is not None:
        log.error("attempt %d: ranks %s made no progress for %.0f s (limit %.0f s); asking every rank for its "
                  "stacks before restarting", a.number, hang.ranks, hang.quiet_s, hang.limit_s)
        c.out += [ToRank(a.number, r, m.DumpStacks(attempt=a.number), watch=True, incarnation=a.reply_to.get(r, 0))
                  for r in w.asked]
    end_hung_attempt(c, a, w)


def end_hung_attempt(c: CoreState, a: AttemptState, w: HangWatch) -> None:
    if not w.explained(c.now) or c.state.kind not in _WATCHED or c.attempt is not a:
        return
    assert w.hang is not None
    record, rank = w.record(c.wall()), w.blamed()
    w.hang = None  # explained once
    c.book.state.hangs.append(record)  # written with the failure, below
    if live_steps.on_hang(c, a, rank, f"rank {rank} hung: {record.summary}"):
        w.restart_clock(rank, c.now)  # the others waited on it: their silence ends with its death
        return
    log.error("attempt %d hung: %s", a.number, record.summary)
    lifecycle.on_failure(c, FailureRecord(
        attempt=a.number, rank=rank, node_id=a.placement.get(rank, ""), pid=a.pids.get(rank, 0), exit_code=None,
        signal=None, time=c.wall(), kind=FailureKind.HANG, message=record.summary))
