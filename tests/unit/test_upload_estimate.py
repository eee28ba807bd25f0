import pytest

from outlast.controller.upload_estimate import UploadEstimate


def test_nothing_in_flight_takes_no_time():
    est = UploadEstimate().estimate(now=5.0)
    assert (est.seconds, est.bytes_left, est.reason) == (0.0, 0, "no upload in flight")


def test_bytes_left_over_bandwidth_counting_what_went_since_the_report():
    up = UploadEstimate()
    up.on_report(rank=0, index=3, nbytes=1_000_000_000, bandwidth_bps=100e6, now=10.0)
    est = up.estimate(now=12.0)  # 200 MB gone in 2 s
    assert est.seconds == pytest.approx(8.0)
    assert est.bytes_left == 800_000_000
    assert "rank 0 is the slowest" in est.reason


def test_the_slowest_rank_decides_and_one_ranks_uploads_add_up():
    up = UploadEstimate()
    up.on_report(0, 1, 100_000_000, 100e6, now=0.0)  # 1 s
    up.on_report(1, 1, 100_000_000, 10e6, now=0.0)  # 10 s
    up.on_report(1, 2, 50_000_000, 10e6, now=0.0)  # 5 s more, after its first
    est = up.estimate(now=0.0)
    assert est.seconds == pytest.approx(15.0)
    assert "rank 1" in est.reason


def test_an_upload_that_overran_its_estimate_counts_as_nearly_done_not_negative():
    up = UploadEstimate()
    up.on_report(0, 1, 1000, 1000.0, now=0.0)
    assert up.estimate(now=60.0).seconds == 0.0


def test_a_rank_without_a_measured_bandwidth_makes_the_answer_unknown_and_says_which():
    up = UploadEstimate()
    up.on_report(0, 1, 1000, 1000.0, now=0.0)
    up.on_report(2, 1, 5000, 0.0, now=0.0)
    est = up.estimate(now=0.0)
    assert est.seconds is None and est.bytes_left == 6000
    assert est.reason == "rank 2 (report #1) has not measured an upload yet"


def test_done_uploads_and_a_new_attempt_leave_the_estimate():
    up = UploadEstimate()
    up.on_report(0, 1, 1000, 10.0, now=0.0)
    up.on_report(1, 1, 1000, 10.0, now=0.0)
    up.on_upload_done(0, 1)
    assert up.estimate(0.0).bytes_left == 1000
    up.clear()
    assert up.estimate(0.0).seconds == 0.0


def test_thousands_of_ranks_are_answered_at_once():
    up = UploadEstimate()
    for rank in range(4096):
        up.on_report(rank, 7, 10_000_000, 100e6 if rank != 4000 else 1e6, now=0.0)
    est = up.estimate(now=0.0)
    assert est.seconds == pytest.approx(10.0)
    assert "rank 4000" in est.reason


def test_an_upload_done_that_overtakes_its_report_leaves_nothing_in_flight():
    up = UploadEstimate()
    up.on_upload_done(0, 4)
    up.on_report(0, 4, 1_000_000, 1e6, now=0.0)
    assert up.estimate(now=0.0).bytes_left == 0
    up.on_report(0, 5, 1_000_000, 1e6, now=0.0)  # the next one counts again
    assert up.estimate(now=0.0).bytes_left == 1_000_000


def test_only_counts_the_uploads_asked_for():
    up = UploadEstimate()
    up.on_report(0, 1, 500_000_000, 10e6, now=0.0)  # 50 s, an older checkpoint
    up.on_report(0, 2, 100_000_000, 10e6, now=0.0)  # 10 s, the notice's
    est = up.estimate(now=0.0, only=lambda rank, index: index >= 2)
    assert est.seconds == 10.0 and est.bytes_left == 100_000_000
