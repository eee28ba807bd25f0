"""What the controller's core does about hangs (`hangs.py` decides): watch each rank's progress, ask every
rank for its stacks once one is stuck, and end the attempt as a failure once they are in.

A part of `ControllerCore`, as `handlers.py` is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from outlast.controller.group import ToRank
from outlast.controller.hangs import HangWatch
from outlast.controller.states import State
from outlast.controller.types import AttemptState
from outlast.protocol import messages as m
from outlast.protocol.kinds import FailureKind
from outlast.storage.records import FailureRecord

if TYPE_CHECKING:
    from outlast.controller.core import ControllerCore

log = logging.getLogger("outlast.controller")

_WATCHED = (State.RUNNING, State.PREEMPTING, State.SAVED)


class HangSteps:
    _hangs: HangWatch | None = None

    def _hang_watch(self: "ControllerCore", a: AttemptState, now: float) -> HangWatch:
        w = self._hangs
        if w is None or w.attempt != a.number:
            w = self._hangs = HangWatch(a.number, self.plan.world_size, self.plan.hang_timeout_s, now)
        return w

    def _on_watch_message(self: "ControllerCore", msg: m.Progress | m.StackDump) -> None:
        a = self.attempt
        assert a is not None
        w = self._hang_watch(a, self._now)
        if isinstance(msg, m.Progress):
            w.on_progress(msg.rank, msg.count, self._now)
            return
        w.on_dump(msg)
        self._end_hung_attempt(a, w)

    def _check_hangs(self: "ControllerCore", a: AttemptState, now: float) -> None:
        if self.state.kind not in _WATCHED:
            return
        w = self._hang_watch(a, now)
        live = [r for r in range(self.plan.world_size) if r not in a.exited]
        hang = w.check(live, now)
        if hang is not None:
            log.error("attempt %d: ranks %s made no progress for %.0f s (limit %.0f s); asking every rank for its "
                      "stacks before restarting", a.number, hang.ranks, hang.quiet_s, hang.limit_s)
            self._out += [ToRank(a.number, r, m.DumpStacks(attempt=a.number), watch=True) for r in w.asked]
        self._end_hung_attempt(a, w)

    def _end_hung_attempt(self: "ControllerCore", a: AttemptState, w: HangWatch) -> None:
        if not w.explained(self._now) or self.state.kind not in _WATCHED or self.attempt is not a:
            return
        assert w.hang is not None
        record, rank = w.record(self.wall()), w.blamed()
        w.hang = None  # explained once
        self.book.state.hangs.append(record)  # written with the failure, below
        log.error("attempt %d hung: %s", a.number, record.summary)
        self._on_failure(FailureRecord(
            attempt=a.number, rank=rank, node_id=a.placement.get(rank, ""), pid=a.pids.get(rank, 0), exit_code=None,
            signal=None, time=self.wall(), exc_type=FailureKind.HANG, message=record.summary))
