"""Storage as effects: the core never calls storage; it hands effects over and hears their answers.

The commit is in two phases (the ranks hear `Committed` once the manifest is written), heartbeats
go on while storage is slow, and a write that still fails after its retries fails the run.
"""

from __future__ import annotations

import threading
import time

import pytest

from outlast.controller import effects as fx
from outlast.controller import group as g
from outlast.controller.executor import EffectQueue, StorageExecutor
from outlast.controller.states import State
from outlast.protocol import messages as m
from outlast.storage.records import MANIFEST_NAME
from outlast.storage.retry import Retrying
from outlast.storage.run_store import RunStore
from tests.fakes.controller import make, start
from tests.fakes.storage import MemoryStorage

ENTRY = m.FileEntry("model.pt", 1, "0" * 64)


def report(h, rank, index):
    return h.worker(m.Report(attempt=1, rank=rank, index=index, metrics={"step": index},
                             checkpoint_dir=f"checkpoint_001_{index:06d}", files=[ENTRY]))


def started(**kw):
    h = make(**kw)
    placement = start(h)
    h.hold_storage = True
    return h, placement


def test_ranks_hear_committed_only_once_storage_says_the_manifest_is_written():
    h, _ = started()
    report(h, 0, 0)
    report(h, 1, 0)
    manifests = [e for e in h.held if isinstance(e, fx.WriteManifest)]
    assert [e.manifest.checkpoint_dir for e in manifests] == ["checkpoint_001_000000"]
    assert h.to_rank(0) == [] and h.to_rank(1) == []
    assert h.core.book.state.latest_checkpoint is None  # not committed until the manifest is
    h.release(manifests[0])
    assert [type(x) for x in h.to_rank(0)] == [m.Committed] == [type(x) for x in h.to_rank(1)]
    assert h.core.book.state.latest_checkpoint == "checkpoint_001_000000"
    # ... and the run state naming it is handed over after the manifest, never before.
    written = [e for e in h.storage_log if isinstance(e, fx.WriteRunState) and b"checkpoint_001_000000" in e.data]
    assert written and h.storage_log.index(written[0]) > h.storage_log.index(manifests[0])


def test_heartbeats_go_out_and_events_are_acted_on_while_a_manifest_write_is_outstanding():
    h, placement = started()
    report(h, 0, 0)
    report(h, 1, 0)
    h.effects.clear()
    for _ in range(20):  # 10 s of storage saying nothing, twice the driver timeout
        h.step(dt=0.5)
        for node_id in set(placement.values()):  # the agents answer the heartbeats
            h.agent(node_id, m.Pong(node_id=node_id, pid=1))
    beats = [e for e in h.effects if isinstance(e, g.ToNode) and isinstance(e.msg, m.RunHeartbeat)]
    assert {e.node_id for e in beats} == set(placement.values()) and len(beats) >= 2 * 9  # one a second or more
    h.agent(placement[1], h.exited(1, placement[1], code=1))  # and what happens meanwhile is acted on
    assert h.state is State.RESTARTING and any(isinstance(e, g.StopRun) for e in h.effects)


def test_retention_deletes_only_after_a_run_state_that_no_longer_names_the_checkpoint():
    h, _ = started(num_to_keep=1)
    for index in (0, 1):
        report(h, 0, index)
        report(h, 1, index)
        h.release()
    deletes = [e for e in h.storage_log if isinstance(e, fx.DeleteCheckpoint)]
    assert [e.checkpoint_dir for e in deletes] == ["checkpoint_001_000000"]
    before = h.storage_log[:h.storage_log.index(deletes[0])]
    last_state = [e for e in before if isinstance(e, fx.WriteRunState)][-1]
    assert b"checkpoint_001_000000" not in last_state.data and b"checkpoint_001_000001" in last_state.data


def test_a_manifest_write_that_still_fails_after_its_retries_fails_the_run_saying_what_storage_did():
    h, placement = started()
    report(h, 0, 0)
    report(h, 1, 0)
    manifest = next(e for e in h.held if isinstance(e, fx.WriteManifest))
    h.held.remove(manifest)
    h.step(fx.StorageFailed(manifest.id, fx.describe(manifest), "EndpointConnectionError: could not connect"))
    assert [type(x) for x in h.to_rank(0)] == [m.CommitFailed]
    assert h.state is State.ERRORED
    text = str(h.core.error)
    assert "storage failed writing the manifest of checkpoint_001_000000" in text
    assert "EndpointConnectionError" in text and "OUTLAST_STORAGE_RETRY_S" in text


def test_the_run_closes_only_once_storage_has_answered_every_effect():
    h, placement = started()
    for rank, node_id in placement.items():
        h.worker(m.WorkerDone(attempt=1, rank=rank, reports=0))
        h.agent(node_id, h.exited(rank, node_id))
    assert h.state is State.FINISHED and not h.core.closed and h.held
    h.release()
    h.step()
    assert h.core.closed


def test_a_slow_call_is_said_and_forgotten_once_answered(caplog):
    h, _ = started()
    report(h, 0, 0)
    report(h, 1, 0)
    manifest = next(e for e in h.held if isinstance(e, fx.WriteManifest))
    h.step(fx.StorageSlow(manifest.id, fx.describe(manifest), 6.0))
    assert h.core.storage_slow is not None and "storage is slow" in caplog.text
    h.release(manifest)
    assert h.core.storage_slow is None


# ---- the queue and the executor -----------------------------------------------------------


def test_a_run_state_write_writes_the_newest_queued_and_the_later_ones_need_no_call():
    q = EffectQueue()
    q.push(fx.WriteRunState(1, b"one"))
    q.push(fx.DeleteCheckpoint(2, "c"))
    q.push(fx.WriteRunState(3, b"three"))
    first, answered = q.pop()
    assert (first.id, first.data, answered) == (1, b"three", [])
    second, answered = q.pop()
    assert second == fx.DeleteCheckpoint(2, "c")
    third, answered = q.pop()
    assert third is None and answered == [fx.StorageDone(3)]


class SlowMemory(MemoryStorage):
    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.threads: set[str] = set()

    def write_atomic(self, path, data):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        super().write_atomic(path, data)


def _answers(executor, until, timeout_s=10.0):
    got, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until(got):
        got += executor.take()
        time.sleep(0.01)
    return got


def test_the_executor_carries_effects_out_in_order_on_a_thread_of_its_own_and_says_a_slow_one():
    mem = SlowMemory(delay_s=0.3)
    executor = StorageExecutor(RunStore(mem, "run"), retry_s=0.0, slow_s=0.1)
    try:
        from tests.unit.test_controller_effects import _manifest

        executor.submit(fx.WriteManifest(1, _manifest("checkpoint_001_000000")))
        executor.submit(fx.WriteRunState(2, b"{}"))
        got = _answers(executor, lambda got: any(isinstance(e, fx.StorageDone) and e.id == 2 for e in got))
    finally:
        executor.close()
    assert [e.id for e in got if isinstance(e, fx.StorageDone)] == [1, 2]
    assert any(isinstance(e, fx.StorageSlow) and e.id == 1 for e in got)
    assert mem.writes() == [f"run/checkpoint_001_000000/{MANIFEST_NAME}", "run/run_state.json"]
    assert mem.threads == {"outlast-storage"}


def _manifest(name):
    from outlast.storage.records import Manifest

    return Manifest(checkpoint_dir=name, seq=1, attempt=1, report_index=0, committed_at=1.0, ranks=[0], files=[ENTRY])


class Flaky(MemoryStorage):
    def __init__(self, failures: int, error: type[OSError] = OSError) -> None:
        super().__init__()
        self.failures, self.error, self.tries = failures, error, 0

    def write_atomic(self, path, data):
        self.tries += 1
        if self.tries <= self.failures:
            raise self.error(f"try {self.tries} failed")
        super().write_atomic(path, data)


def test_a_storage_call_is_retried_with_backoff_until_it_succeeds():
    slept = []
    mem = Flaky(failures=3)
    Retrying(60.0, sleep=slept.append)(mem.write_atomic, "x", b"1")
    assert mem.tries == 4 and mem.files["x"] == b"1"
    assert len(slept) == 3 and slept == sorted(slept) and slept[0] > 0


def test_the_first_try_is_made_alone_and_the_retries_after_it_are_tenacitys_own():
    import tenacity

    from outlast.storage.retry import transient

    for failures, budget in ((0, 60.0), (1, 60.0), (5, 60.0), (100, 3.0), (3, 0.0)):
        runs = []
        for retrying in ("ours", "tenacity"):
            slept, told, mem = [], [], Flaky(failures=failures)

            def on_retry(state, told=told):
                told.append((state.attempt_number, str(state.outcome.exception())))

            if retrying == "ours":
                call = Retrying(budget, sleep=slept.append, on_retry=on_retry)
            else:
                call = tenacity.Retrying(retry=tenacity.retry_if_exception(transient),
                                         wait=tenacity.wait_exponential(multiplier=0.25, min=0.25, max=5.0),
                                         stop=lambda state, budget=budget: state.idle_for >= budget, sleep=slept.append,
                                         reraise=True, before_sleep=on_retry)
            try:
                call(mem.write_atomic, "x", b"1")
                raised = None
            except OSError as e:
                raised = str(e)
            runs.append((mem.tries, slept, told, raised))
        assert runs[0] == runs[1]


def test_retries_stop_once_their_budget_of_waiting_is_spent():
    slept = []
    with pytest.raises(OSError, match="failed"):
        Retrying(3.0, sleep=slept.append)(Flaky(failures=100).write_atomic, "x", b"1")
    assert sum(slept[:-1]) < 3.0 <= sum(slept)


def test_a_refused_permission_or_a_missing_file_is_not_retried():
    for error in (PermissionError, FileNotFoundError):
        mem = Flaky(failures=1, error=error)
        with pytest.raises(error):
            Retrying(60.0, sleep=lambda s: None)(mem.write_atomic, "x", b"1")
        assert mem.tries == 1


def test_a_run_whose_last_commit_is_reading_back_its_files_finishes_only_after_and_keeps_them():
    import hashlib

    h, placement = started()
    for rank, digest in ((0, hashlib.sha256(b"x").hexdigest()), (1, "b" * 64)):  # both wrote pad.bin, differently
        h.worker(m.Report(attempt=1, rank=rank, index=0, metrics={}, checkpoint_dir="checkpoint_001_000000",
                          files=[m.FileEntry("pad.bin", 1, digest)]))
    assert [type(e) for e in h.held] == [fx.ReadChecksums]
    for rank, node_id in placement.items():
        h.worker(m.WorkerDone(attempt=1, rank=rank, reports=1))
        h.agent(node_id, h.exited(rank, node_id))
    assert h.state is State.FINISHING  # not FINISHED while its last commit is under way
    h.core.book.store.storage.write_atomic("run/checkpoint_001_000000/pad.bin", b"x")
    while h.held:
        h.release(h.held[0])
    assert h.state is State.FINISHED and h.core.book.state.latest_checkpoint == "checkpoint_001_000000"
    removals = [e for e in h.storage_log if isinstance(e, fx.RemoveUncommitted)]
    assert all("checkpoint_001_000000" in e.keep for e in removals[1:])  # the first one is the attempt's start


def _kept(h, rank):
    return [[c.checkpoint_dir for c in x.checkpoints] for x in h.to_rank(rank) if isinstance(x, m.CheckpointsList)]


def test_the_kept_checkpoints_are_answered_from_the_history_once_the_asking_ranks_reports_are_committed():
    h, _ = started(num_to_keep=1)
    report(h, 0, 0)
    report(h, 1, 0)
    h.release()
    report(h, 0, 1)
    report(h, 1, 1)
    h.effects.clear()
    # Rank 1 asks while checkpoint 1's manifest is still being written: it waits, and storage's
    # run state (which names checkpoint 0 still) is never what it is told.
    h.worker(m.CheckpointsQuery(attempt=1, rank=1, reports=2))
    assert _kept(h, 1) == []
    h.release()
    assert _kept(h, 1) == [["checkpoint_001_000001"]]  # checkpoint 0 is gone by retention
    # A rank whose reports have all settled is answered at once.
    h.worker(m.CheckpointsQuery(attempt=1, rank=0, reports=2))
    assert _kept(h, 0) == [["checkpoint_001_000001"]]


def test_a_rank_asking_for_the_kept_checkpoints_waits_for_its_asynchronous_upload_and_the_other_ranks_report():
    h, _ = started()
    h.worker(m.Report(attempt=1, rank=0, index=0, metrics={}, checkpoint_dir="checkpoint_001_000000",
                      upload_pending=True))
    h.worker(m.CheckpointsQuery(attempt=1, rank=0, reports=1))
    h.worker(m.UploadDone(attempt=1, rank=0, index=0, checkpoint_dir="checkpoint_001_000000", files=[ENTRY]))
    h.release()
    assert _kept(h, 0) == []  # rank 1 has not reported checkpoint 0 yet: it is not settled
    report(h, 1, 0)
    h.release()
    assert _kept(h, 0) == [["checkpoint_001_000000"]]


def test_the_clean_up_a_restart_asks_for_spares_the_new_attempts_uploads_when_slow_storage_reaches_it_late():
    """Effects go in order: behind a slow call, the removal of attempt 1's garbage may run after attempt 2's
    ranks started uploading (sim seed 556). Their directories, with no manifest yet, are not garbage."""
    h, placement = started(max_failures=1)
    h.agent(placement[1], h.exited(1, placement[1], code=1))
    h.agent(placement[0], h.exited(0, placement[0], code=1))
    removal = [e for e in h.held if isinstance(e, fx.RemoveUncommitted)][-1]
    assert h.core.attempt.number == 2
    while h.held[0] is not removal:
        h.release(h.held[0])
    assert h.spawned() and h.core.attempt.number == 2  # attempt 2 is placed before storage reaches the removal
    storage = h.core.book.store.storage
    storage.write_atomic("run/checkpoint_001_000003/model.pt", b"attempt 1, never reported")
    storage.write_atomic("run/checkpoint_002_000000/model.pt", b"attempt 2, uploading")
    h.release(removal)
    assert not storage.exists("run/checkpoint_001_000003")
    assert storage.read_bytes("run/checkpoint_002_000000/model.pt") == b"attempt 2, uploading"


def test_a_restore_that_finds_the_manifest_rewritten_by_a_newer_outlast_stops_the_run_saying_so():
    """Neither skipped (restarting from an older checkpoint would lose the newer run's work) nor restored."""
    import json

    h, placement = started(max_failures=1)
    report(h, 0, 0)
    report(h, 1, 0)
    h.release()
    storage = h.core.book.store.storage
    path = f"run/checkpoint_001_000000/{MANIFEST_NAME}"
    doc = json.loads(storage.read_bytes(path))
    storage.write_atomic(path, json.dumps({**doc, "version": doc["version"] + 1}).encode())
    for rank, node_id in placement.items():
        h.agent(node_id, h.exited(rank, node_id, code=1))
    h.release()
    assert h.state is State.ERRORED
    assert "written by a newer outlast" in str(h.core.error) and "upgrade outlast" in str(h.core.error)
    assert h.core.book.state.latest_checkpoint == "checkpoint_001_000000" and not h.core.book.state.skipped_checkpoints
    assert json.loads(storage.read_bytes(path))["version"] == doc["version"] + 1


def test_the_checkpoint_an_attempt_restores_outlives_num_to_keep_only_until_that_attempt_commits_its_own():
    h, placement = started(max_failures=1, num_to_keep=1)
    for index in (0, 1):
        report(h, 0, index)
        report(h, 1, index)
        h.release()
    for rank, node_id in placement.items():
        h.agent(node_id, h.exited(rank, node_id, code=1))
    h.release()
    assert h.core.attempt.number == 2 and h.core.attempt.restore == "checkpoint_001_000001"
    start(h)

    def report2(index):
        for rank in (0, 1):
            h.worker(m.Report(attempt=2, rank=rank, index=index, metrics={"step": 10 + index},
                              checkpoint_dir=f"checkpoint_002_{index:06d}", files=[ENTRY]))
        h.release()

    report2(0)  # its first commit: every rank has read past its restore
    kept = [r.checkpoint_dir for r in h.core.book.state.checkpoints]
    assert kept == ["checkpoint_002_000000"], kept
    report2(1)
    assert [r.checkpoint_dir for r in h.core.book.state.checkpoints] == ["checkpoint_002_000001"]
    deleted = [e.checkpoint_dir for e in h.storage_log if isinstance(e, fx.DeleteCheckpoint)]
    assert deleted == ["checkpoint_001_000000", "checkpoint_001_000001", "checkpoint_002_000000"]
