"""The controller core and the upload estimate: a notice's checkpoint that cannot upload in time is said at
once, and the deadline's reason names the bytes left and their rate."""

from __future__ import annotations

import logging

from outlast.controller import group as g
from outlast.controller.states import State
from outlast.protocol import messages as m
from outlast.controller import preempt_steps
from tests.fakes.controller import make, node, start

ENTRY = m.FileEntry("model.pt", 1, "0" * 64)
GB = 1_000_000_000


def ckpt(h, index):
    return f"checkpoint_{h.core.attempt.number:03d}_{index:06d}"


def report(h, rank, index, nbytes, bps, saw=True):
    """An ASYNC report: its files follow in an UploadDone."""
    h.worker(m.Report(attempt=h.core.attempt.number, rank=rank, index=index, metrics={"step": index},
                      checkpoint_dir=ckpt(h, index), upload_pending=True, saw_preemption=saw,
                      upload_bytes=nbytes, upload_bandwidth_bps=bps))


def upload_done(h, rank, index):
    h.worker(m.UploadDone(attempt=h.core.attempt.number, rank=rank, index=index, checkpoint_dir=ckpt(h, index),
                          files=[ENTRY]))


def drain(h, node_id, in_s):
    h.agent(node_id, m.NodeDraining(node_id=node_id, reason="spot", message="", deadline_unix_s=h.wall() + in_s))


def committed_before_the_notice(h):
    for rank in (0, 1):
        report(h, rank, 0, GB, 100e6, saw=False)
        upload_done(h, rank, 0)
    assert h.core.book.state.latest_checkpoint == ckpt(h, 0)


def test_a_notice_checkpoint_slower_than_the_deadline_is_said_at_once_in_the_log_and_history(caplog):
    h = make()
    placement = start(h)
    committed_before_the_notice(h)
    drain(h, placement[0], in_s=20)
    assert h.state is State.PREEMPTING
    with caplog.at_level(logging.WARNING, logger="outlast.controller"):
        report(h, 0, 1, GB, 100e6)  # 10 s: fits
        assert not h.core.book.state.notes
        report(h, 1, 1, GB, 10e6)  # 100 s at 10 MB/s: does not
    notes = [n.text for n in h.core.book.state.notes]
    assert len(notes) == 1
    assert "needs 100.0 s to upload" in notes[0] and "deadline is in 20.0 s" in notes[0]
    assert "rank 1 is the slowest, 1000.0 MB at 10.0 MB/s" in notes[0]
    assert f"restarts from {ckpt(h, 0)} at the deadline" in notes[0]
    assert any("needs 100.0 s" in r.getMessage() for r in caplog.records)
    # Said once, not on every later report; and the run waits for the deadline, not less.
    report(h, 0, 2, GB, 10e6)
    assert len(h.core.book.state.notes) == 1
    h.step(dt=19.0)
    assert h.state is State.PREEMPTING


def test_at_the_deadline_the_reason_names_the_bytes_still_uploading_and_their_rate(caplog):
    h = make()
    placement = start(h)
    drain(h, placement[0], in_s=20)
    report(h, 0, 0, GB, 100e6)
    report(h, 1, 0, GB, 10e6)
    with caplog.at_level(logging.WARNING, logger="outlast.controller"):
        h.step(dt=21.0)
    assert h.state is State.RESTARTING
    said = [r.getMessage() for r in caplog.records if "deadline has passed" in r.getMessage()]
    # 21 s at 10 MB/s took 210 MB of rank 1's gigabyte; rank 0's was done after 10 s
    assert said and "still uploading: 790.0 MB left; rank 1 is the slowest, 790.0 MB at 10.0 MB/s" in said[0]
    assert "restarting from scratch" in said[0]


def test_an_upload_that_fits_says_nothing_and_its_commit_restarts_at_once():
    h = make()
    placement = start(h)
    drain(h, placement[0], in_s=20)
    report(h, 0, 0, GB, 1e9)
    report(h, 1, 0, GB, 1e9)
    assert not h.core.book.state.notes
    upload_done(h, 0, 0)
    upload_done(h, 1, 0)
    assert h.state is State.RESTARTING
    assert h.core.book.state.latest_checkpoint == ckpt(h, 0)


def test_uploads_from_before_the_notice_do_not_count_against_the_notice_checkpoint():
    h = make()
    placement = start(h)
    report(h, 0, 0, 10 * GB, 10e6, saw=False)  # 1000 s, still in flight at the notice
    drain(h, placement[0], in_s=20)
    report(h, 0, 1, GB, 1e9)
    report(h, 1, 1, GB, 1e9)
    assert not h.core.book.state.notes
    est = preempt_steps.jit_uploads(h.core, h.core.state.preemption, h.now)
    assert est.bytes_left == 2 * GB


def test_an_unmeasured_rate_warns_of_nothing_and_the_deadline_still_names_the_bytes(caplog):
    h = make()
    placement = start(h)
    drain(h, placement[0], in_s=5)
    report(h, 0, 0, GB, 0.0)
    assert not h.core.book.state.notes
    with caplog.at_level(logging.WARNING, logger="outlast.controller"):
        h.step(dt=6.0)
    said = [r.getMessage() for r in caplog.records if "deadline has passed" in r.getMessage()]
    assert said and "1000.0 MB left; rank 0 (report #0) has not measured an upload yet" in said[0]


def test_a_new_attempt_forgets_the_old_attempts_uploads():
    h = make()
    placement = start(h)
    drain(h, placement[0], in_s=5)
    report(h, 0, 0, GB, 10e6)
    h.step(dt=6.0)
    for rank, node_id in placement.items():
        h.agent(node_id, h.exited(rank, node_id, code=None))
    h.step(g.NodeTable([node(n) for n in ("n1", "n2", "n3")]))
    assert h.core.attempt.number == 2
    assert h.core.uploads.estimate(h.now).bytes_left == 0
