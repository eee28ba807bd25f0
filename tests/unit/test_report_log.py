"""Rank 0's reports reach storage through the report log's own thread, every one of them, in order,
across segments; a failed write is retried with the next, and the loop never waits on storage."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from outlast.controller import group as g
from outlast.controller.effects import WriteRunState
from outlast.controller.report_log import ReportLog
from outlast.controller.states import State
from outlast.protocol import messages as m
from outlast.storage.local import LocalStorage
from outlast.storage.records import REPORTS_PER_SEGMENT
from outlast.storage.run_store import RunStore
from tests.integration.procs import wait_until


class Core:
    def __init__(self) -> None:
        self.t = 1000.0
        self.state = SimpleNamespace(kind=State.RUNNING)

    def wall(self) -> float:
        self.t += 1.0
        return self.t


def _report(attempt: int, rank: int, index: int) -> g.FromWorker:
    return g.FromWorker(m.Report(attempt=attempt, rank=rank, index=index, metrics={"loss": 1.0 / (index + 1)}))


def test_every_report_of_rank_0_is_kept_in_order_across_segments(tmp_path):
    store = RunStore(LocalStorage(str(tmp_path)), "run")
    log = ReportLog(store, flush_s=0.01)
    core = Core()
    n = REPORTS_PER_SEGMENT + 7  # one full segment and the start of the next
    for i in range(n):
        log.observe(_report(1, 0, i), [], core, 0.0, 0.0)
        log.observe(_report(1, 1, i), [], core, 0.0, 0.0)  # another rank's: not kept
    log.observe(_report(2, 0, 0), [], core, 0.0, 0.0)
    log.close()
    kept = store.read_reports(1)
    assert [r.index for r in kept] == list(range(n))
    assert kept[-1].metrics == {"loss": 1.0 / n}
    assert [r.time for r in kept] == sorted(r.time for r in kept)
    assert [r.index for r in store.read_reports(2)] == [0]
    assert store.read_reports(3) == []
    assert (tmp_path / "run" / "reports" / "0001_00001000.json").exists()


class FlakyStorage(LocalStorage):
    """Refuses the first write; blocks the second until told, to show the loop does not wait."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.writes = 0
        self.release = threading.Event()

    def write_atomic(self, path: str, data: bytes) -> None:
        self.writes += 1
        if self.writes == 1:
            raise OSError(5, "Input/output error")
        if self.writes == 2:
            assert self.release.wait(30)
        super().write_atomic(path, data)


def test_a_failed_write_is_retried_and_a_slow_one_does_not_hold_the_loop(tmp_path):
    storage = FlakyStorage(str(tmp_path))
    store = RunStore(storage, "run")
    log = ReportLog(store, flush_s=0.01)
    core = Core()
    log.observe(_report(1, 0, 0), [], core, 0.0, 0.0)
    wait_until(lambda: storage.writes == 2, 30, "the retry of the refused write, which then hangs")
    for i in range(1, 50):  # while that write hangs, the loop goes on
        log.observe(_report(1, 0, i), [], core, 0.0, 0.0)
    assert storage.writes == 2 and not storage.release.is_set()
    storage.release.set()
    log.close()
    assert [r.index for r in store.read_reports(1)] == list(range(50))
    assert storage.writes >= 3


def test_a_fenced_driver_writes_no_reports(tmp_path):
    store = RunStore(LocalStorage(str(tmp_path)), "run")
    store.fence("another driver holds the run")
    log = ReportLog(store, flush_s=0.01)
    log.observe(_report(1, 0, 0), [], Core(), 0.0, 0.0)
    log.close()
    assert store.read_reports(1) == []


def test_a_reports_checkpoint_stall_is_kept_with_it(tmp_path):
    store = RunStore(LocalStorage(str(tmp_path)), "run")
    log = ReportLog(store, flush_s=0.01)
    log.observe(g.FromWorker(m.Report(attempt=1, rank=0, index=0, metrics={})), [], Core(), 0.0, 0.0)
    log.observe(g.FromWorker(m.Report(attempt=1, rank=0, index=1, metrics={}, stalled_s=2.5)), [], Core(), 0.0, 0.0)
    log.close()
    assert [r.stalled_s for r in store.read_reports(1)] == [0.0, 2.5]


def test_every_report_is_on_storage_before_the_runs_terminal_state_is_written(tmp_path):
    """The dashboard stops polling a run whose state says it is over: by then its chart must be whole."""
    store = RunStore(LocalStorage(str(tmp_path)), "run")
    log = ReportLog(store, flush_s=60.0)  # left alone, the log would write nothing for a minute
    core = Core()
    for i in range(5):
        log.observe(_report(1, 0, i), [], core, 0.0, 0.0)
    log.observe(g.FromWorker(m.WorkerDone(attempt=1, rank=0, reports=5)), [WriteRunState(id=1, data=b"{}")], core, 0.0, 0.0)
    assert store.read_reports(1) == []  # a state written while the run goes on waits for nothing
    core.state = SimpleNamespace(kind=State.FINISHED)
    log.observe(g.FromWorker(m.WorkerDone(attempt=1, rank=1, reports=5)), [WriteRunState(id=2, data=b"{}")], core, 0.0, 0.0)
    assert [r.index for r in store.read_reports(1)] == list(range(5))  # before the effect is carried out
    log.close()


class DownStorage(LocalStorage):
    """Refuses every write, as a store that is down does."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.writes = 0

    def write_atomic(self, path: str, data: bytes) -> None:
        self.writes += 1
        raise OSError(111, "Connection refused")


def test_a_store_that_is_down_holds_the_runs_end_no_longer_than_the_storage_retry_budget(tmp_path, monkeypatch):
    """The terminal state's write gives up after OUTLAST_STORAGE_RETRY_S; the last reports do too, after one more
    try, where they once held the run's end for half a minute."""
    monkeypatch.setenv("OUTLAST_STORAGE_RETRY_S", "0")
    storage = DownStorage(str(tmp_path))
    log = ReportLog(RunStore(storage, "run"), flush_s=60.0)
    core = Core()
    log.observe(_report(1, 0, 0), [], core, 0.0, 0.0)
    core.state = SimpleNamespace(kind=State.ERRORED)
    log.observe(g.FromWorker(m.WorkerDone(attempt=1, rank=0, reports=1)), [WriteRunState(id=1, data=b"{}")], core,
                0.0, 0.0)
    assert storage.writes == 1  # tried once at the end, then given up
    assert log._thread is not None and not log._thread.is_alive()
