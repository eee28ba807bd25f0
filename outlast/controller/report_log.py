"""Rank 0's reports, kept on storage beside the run state (`reports/`), for the dashboard's charts.

A watcher of the controller's loop (see runtime.Controller): `observe` only appends to a buffer,
and a thread of its own writes the segments that changed, once a second, so the loop never waits
on storage, except once: the run's terminal state goes to storage after its last reports, so a
reader that sees the run over (the dashboard stops polling then) sees every report. A write that fails
is retried with the next; the run is never at risk from it, since the reports are a record of what
happened, not a part of any checkpoint. That last wait is bounded by the storage retry budget
(`OUTLAST_STORAGE_RETRY_S`), as the terminal state's own write is: a storage that is down does not
hold the run's end for longer than one storage call would.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from outlast.controller import group as g
from outlast.controller.effects import WriteRunState
from outlast.protocol import messages as m
from outlast.storage.records import REPORTS_PER_SEGMENT, ReportEntry, ReportSegment
from outlast.storage.retry import retry_budget_s
from outlast.storage.run_store import RunStore

if TYPE_CHECKING:
    from outlast.controller.core import ControllerCore
    from outlast.controller.effects import StorageEffect, TierAsk

log = logging.getLogger("outlast.controller")

FLUSH_S = 1.0


class ReportLog:
    def __init__(self, store: RunStore, flush_s: float = FLUSH_S, give_up_s: float | None = None) -> None:
        self.store = store
        self.flush_s = flush_s
        self.give_up_s = retry_budget_s() if give_up_s is None else give_up_s
        self._lock = threading.Lock()
        self._segments: dict[tuple[int, int], list[ReportEntry]] = {}
        self._dirty: set[tuple[int, int]] = set()
        self._wake = threading.Event()
        self._closed = False
        self._give_up_at = 0.0
        self._failing = False
        self._thread: threading.Thread | None = None

    def observe(self, event: Any, effects: list[g.Effect | StorageEffect | TierAsk], core: "ControllerCore",
                start: float, end: float) -> None:
        if isinstance(event, g.FromWorker) and isinstance(event.msg, m.Report) and event.msg.rank == 0:
            self._keep(event.msg, core.wall())
        # Watchers see a step's effects before they are carried out: the terminal state is written after this.
        if core.state.kind.is_terminal and any(isinstance(e, WriteRunState) for e in effects) and not self._closed:
            self.close()

    def _keep(self, msg: m.Report, wall: float) -> None:
        key = (msg.attempt, msg.index // REPORTS_PER_SEGMENT * REPORTS_PER_SEGMENT)
        with self._lock:
            self._segments.setdefault(key, []).append(ReportEntry(index=msg.index, time=wall,
                                                                  metrics=msg.metrics, stalled_s=msg.stalled_s))
            self._dirty.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="outlast-report-log", daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Write what is left, retrying for up to `give_up_s`; called once the run's loop is over."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._give_up_at = time.monotonic() + self.give_up_s
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join(self.give_up_s + self.flush_s)  # a write that hangs past the budget is left to its thread

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            with self._lock:
                closed = self._closed
            self._flush()
            with self._lock:
                if closed and (not self._dirty or time.monotonic() > self._give_up_at):
                    return

    def _flush(self) -> None:
        with self._lock:
            todo = [(key, list(self._segments[key])) for key in sorted(self._dirty)]
            self._dirty.clear()
        for (attempt, first), reports in todo:
            try:
                self.store.write_reports(ReportSegment(attempt=attempt, first_index=first, reports=reports))
            except OSError as e:
                with self._lock:
                    self._dirty.add((attempt, first))
                if not self._failing:
                    log.warning("could not keep the reports of attempt %d on storage (%s); retrying", attempt, e)
                self._failing = True
                return
            with self._lock:  # a full segment is written for the last time: drop it from memory
                if len(self._segments[(attempt, first)]) >= REPORTS_PER_SEGMENT and (attempt, first) not in self._dirty:
                    del self._segments[(attempt, first)]
        self._failing = False
