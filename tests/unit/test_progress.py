"""The driver's progress line: what a run waits on (pure, on a fake clock), drawn in place on a
terminal and as plain log lines elsewhere; the lease wait's countdown; a restore's bytes and rate
as a real worker-side reporter sends them over a real socket."""

from __future__ import annotations

import io
import logging
import threading
import time

import msgspec
import zmq

import outlast.train  # noqa: F401  (first: the training API and the controller import each other)
from outlast.controller import states as st
from outlast.controller.preemption import Preemption
from outlast.controller.progress import Fetch, ProgressLine, describe
from outlast.protocol import messages as m
from outlast.protocol.transport import WORKER_MESSAGES, bind_router
from outlast.storage import open_storage
from outlast.storage.records import Manifest
from outlast.storage.run_store import RunStore
from outlast.train import fetch_progress
from tests.unit.test_driver_lease import Clock, keeper


def _preemption(deadline: float) -> Preemption:
    notice = m.NodeDraining(node_id="node-2", reason="preemption", message="", deadline_unix_s=None)
    return Preemption(notice=notice, ranks=[1], node_ids=["node-2"], noticed_at=0.0, deadline=deadline,
                      reports_at_notice=[0, 0])


def test_waiting_for_capacity_says_what_is_missing_and_when_it_gives_up():
    state = st.WaitingForCapacity(since=100.0, reason="2 worker(s) need CPU=4; the largest node has CPU=2",
                                  retry_at=101.0)
    what, line = describe(state, None, now=130.0, capacity_s=600.0)
    assert what == "capacity"
    assert "the largest node has CPU=2" in line and "waited 30 s" in line and "gives up in 570 s" in line


def test_a_preemption_counts_its_deadline_down():
    _, first = describe(st.Preempting(_preemption(deadline=160.0)), None, now=130.0, capacity_s=600.0)
    _, later = describe(st.Preempting(_preemption(deadline=160.0)), None, now=150.0, capacity_s=600.0)
    assert "node(s) node-2" in first and "at most 30 s" in first and "at most 10 s" in later
    _, saved = describe(st.Saved(_preemption(160.0), "checkpoint_001_000004"), None, now=150.0, capacity_s=600.0)
    assert "checkpoint_001_000004 committed" in saved


def test_a_restore_shows_the_slowest_ranks_bytes_and_rate_until_every_rank_has_it():
    fetch = Fetch("checkpoint_001_000009", 2, {0: 50 << 20, 1: 20 << 20}, 100 << 20, started=10.0, finished=set())
    what, line = describe(st.Running(), fetch, now=12.0, capacity_s=600.0)
    assert what == "restore" and "20.0 MiB of 100.0 MiB" in line and "(10.0 MiB/s)" in line
    fetch.finished |= {0, 1}
    assert describe(st.Running(), fetch, now=13.0, capacity_s=600.0) is None
    assert describe(st.Running(), None, now=13.0, capacity_s=600.0) is None


def test_on_a_terminal_the_line_is_redrawn_in_place_and_cleared_when_the_wait_ends():
    out = io.StringIO()
    line = ProgressLine(stream=lambda: out, tty=True)
    line.show(("capacity", "waiting A"), 0.0)
    line.show(("capacity", "waiting B"), 0.1)  # too soon: not redrawn
    line.show(("capacity", "waiting C"), 0.5)
    line.show(None, 0.6)
    assert out.getvalue() == "\r\x1b[Kwaiting A\r\x1b[Kwaiting C\r\x1b[K"


def test_elsewhere_plain_log_lines_when_the_wait_changes_and_now_and_then(caplog):
    out = io.StringIO()
    line = ProgressLine(stream=lambda: out, tty=False)
    with caplog.at_level(logging.INFO, logger="outlast.progress"):
        line.show(("capacity", "waiting A"), 0.0)
        line.show(("capacity", "waiting B"), 5.0)
        line.show(("capacity", "waiting C"), 10.5)
        line.show(("preemption", "preempted"), 11.0)
        line.show(None, 12.0)
    assert [r.getMessage() for r in caplog.records] == ["waiting A", "waiting C", "preempted",
                                                        "no longer waiting for preemption"]
    assert out.getvalue() == ""  # no control characters where no terminal reads them


def test_a_relaunched_driver_is_told_how_long_the_previous_lease_has_left(tmp_path):
    clock = Clock()
    old = keeper(tmp_path, "machine-a/boot-1/pid:[1]", clock)
    old.acquire()
    new = keeper(tmp_path, "machine-b/boot-7/pid:[1]", clock)
    told: list[tuple[str, float]] = []
    new.acquire(on_wait=lambda why, left: told.append((why, left)))
    assert told and told[0][1] == 10.0 and told[-1][1] < told[0][1]
    assert all(why for why, _ in told)


def test_the_worker_side_reporter_sends_the_bytes_on_disk_then_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch_progress, "EVERY_S", 0.05)
    store = RunStore(open_storage(tmp_path / "storage"), "run")
    files = [m.FileEntry(path="w.bin", size=3000)]
    store.storage.write_atomic("run/checkpoint_001_000004/.outlast-manifest.json", msgspec.json.encode(Manifest(
        checkpoint_dir="checkpoint_001_000004", seq=1, attempt=1, report_index=4, committed_at=0, ranks=[0],
        files=files)))
    partial = tmp_path / "cache" / "abc" / ".checkpoint_001_000004.partial-123"
    partial.mkdir(parents=True)
    (partial / "w.bin").write_bytes(b"x" * 1000)
    ctx = zmq.Context()
    router, address = bind_router(ctx, "127.0.0.1")
    stop = threading.Event()
    thread = threading.Thread(target=fetch_progress._report, args=(store, "checkpoint_001_000004",
                                                                   tmp_path / "cache", address, 2, 1, stop))
    thread.start()
    try:
        got = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (got and got[-1].finished):
            if router.poll(100):
                got.append(WORKER_MESSAGES.decode(router.recv_multipart()[-1]))
            if got and not stop.is_set():
                stop.set()
        assert got[0] == m.RestoreProgress(attempt=2, rank=1, checkpoint_dir="checkpoint_001_000004",
                                           fetched_bytes=1000, total_bytes=3000)
        assert got[-1].finished and got[-1].fetched_bytes == 3000
    finally:
        stop.set()
        thread.join(5)
        router.close(linger=0)
        ctx.term()


def test_a_slow_storage_call_is_said_with_what_it_is_and_how_long_it_has_taken():
    from outlast.controller.effects import StorageSlow

    what, line = describe(st.Running(), None, 10.0, 600.0, StorageSlow(3, "deleting checkpoint_001_000001", 12.4))
    assert what == "storage"
    assert "deleting checkpoint_001_000001" in line and "12 s" in line


def test_a_progress_message_dropped_on_a_full_queue_does_not_end_the_reports(tmp_path, monkeypatch):
    """The queue to a driver that far behind drops a message; each says all the earlier ones did, so the next
    replaces it, and the last one (finished) still goes."""
    monkeypatch.setattr(fetch_progress, "EVERY_S", 0.05)
    sent = []
    dropped = [3]

    def full_then_not(sock, msg):
        if dropped[0]:
            dropped[0] -= 1
            return False
        sent.append(msg)
        return True

    monkeypatch.setattr(fetch_progress, "send_or_drop", full_then_not)
    store = RunStore(open_storage(tmp_path / "storage"), "run")
    store.storage.write_atomic("run/checkpoint_001_000004/.outlast-manifest.json", msgspec.json.encode(Manifest(
        checkpoint_dir="checkpoint_001_000004", seq=1, attempt=1, report_index=4, committed_at=0, ranks=[0],
        files=[m.FileEntry(path="w.bin", size=3000)])))
    stop = threading.Event()
    thread = threading.Thread(target=fetch_progress._report, args=(store, "checkpoint_001_000004",
                                                                   tmp_path / "cache", "tcp://127.0.0.1:9", 2, 1, stop))
    thread.start()
    deadline = time.monotonic() + 30
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    assert sent and not sent[0].finished and sent[-1].finished and sent[-1].fetched_bytes == 3000
