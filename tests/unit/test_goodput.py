"""The split of a run's held time into goodput's parts (outlast/storage/goodput.py), on histories written here."""

from __future__ import annotations

import math

import pytest

from outlast.protocol.kinds import FailureKind
from outlast.storage.goodput import PARTS, describe, split
from outlast.storage.records import (
    AttemptRecord, CheckpointRecord, DrainRecord, FailureRecord, HangRecord, LiveRecoveryRecord, ReportEntry,
    ResizeRecord, RunState,
)


def state(*attempts: AttemptRecord, **kw) -> RunState:
    return RunState(name="r", status=kw.pop("status", "finished"), created_at=0.0, updated_at=0.0,
                    attempts=list(attempts), **kw)


def attempt(n: int, start: float, end: float | None, outcome: str | None, **kw) -> AttemptRecord:
    return AttemptRecord(attempt=n, started_at=start, ended_at=end, outcome=outcome, **kw)


def reports(times: list[float], stalls: dict[int, float] | None = None) -> list[ReportEntry]:
    return [ReportEntry(index=i, time=t, metrics={}, stalled_s=(stalls or {}).get(i, 0.0)) for i, t in enumerate(times)]


def failure(n: int, t: float, kind: FailureKind | None = None) -> FailureRecord:
    return FailureRecord(attempt=n, rank=0, node_id="n", pid=1, exit_code=None, signal=9, time=t, kind=kind)


def adds_up(g, whole: float) -> None:
    assert math.isclose(sum(g.parts().values()), g.held_s, abs_tol=1e-9)
    assert math.isclose(g.held_s, whole, abs_tol=1e-9)
    assert all(v >= 0 for v in g.parts().values())


def test_a_run_without_failures_is_start_up_then_steps_then_its_ending():
    g = split(state(attempt(1, 0.0, 12.0, "finished")), {1: reports([2.0, 4.0, 6.0, 10.0])}, now=99.0)
    adds_up(g, 12.0)
    assert (g.startup_s, g.productive_s, g.ending_s) == (2.0, 8.0, 2.0)
    assert g.steps == 3 and g.restarts_s == 0 and g.replayed_s == 0
    assert math.isclose(g.fraction, 8 / 12)


def test_a_checkpoint_stall_is_taken_out_of_the_step_it_came_with():
    g = split(state(attempt(1, 0.0, 10.0, "finished")), {1: reports([1.0, 4.0, 6.0], stalls={1: 2.5, 2: 9.0})},
              now=99.0)
    adds_up(g, 10.0)
    # a stall longer than its step (clocks of two machines) is capped at the step
    assert g.checkpoint_stalls_s == 2.5 + 2.0
    assert g.productive_s == 0.5


def test_a_failure_before_the_first_step_is_start_up_then_a_restart_to_the_next_first_step():
    s = state(attempt(1, 0.0, 3.0, "failed", failures=[failure(1, 2.0)]), attempt(2, 3.0, 9.0, "finished"))
    g = split(s, {2: reports([5.0, 7.0, 8.0])}, now=99.0)
    adds_up(g, 9.0)
    assert g.startup_s == 3.0  # the failed attempt never reached a step: its whole span is its start-up
    assert g.restarts_s == 2.0  # attempt 2's placing to its first report
    assert g.productive_s == 3.0 and g.ending_s == 1.0


def test_a_restore_that_replays_steps_charges_them_as_trained_again():
    ckpt = CheckpointRecord(checkpoint_dir="ck", seq=1, attempt=1, report_index=1, committed_at=2.0)
    s = state(attempt(1, 0.0, 6.5, "failed", failures=[failure(1, 6.0)]),
              attempt(2, 6.5, 14.0, "finished", restored_from="ck"), checkpoints=[ckpt])
    # attempt 1 reaches 4 reports; attempt 2 restores report 1's checkpoint (progress 2), so its reports 0 and 1
    # (progress 3 and 4) are trained again, and its report 2 (progress 5) is new
    g = split(s, {1: reports([1.0, 2.0, 3.0, 4.0]), 2: reports([8.0, 9.0, 10.0, 12.0])}, now=99.0)
    adds_up(g, 14.0)
    assert g.replayed_steps == 1 and g.replayed_s == 1.0  # report 1 of attempt 2; report 0 closed its start-up
    assert g.restarts_s == (6.5 - 4.0) + (8.0 - 6.5)  # the step in flight at the failure, then the restart
    assert g.productive_s == 3.0 + 1.0 + 2.0 and g.steps == 5


def test_a_restore_by_default_name_after_retention_deleted_its_record_still_counts_replays():
    s = state(attempt(1, 0.0, 5.0, "failed", failures=[failure(1, 5.0)]),
              attempt(2, 5.0, 9.0, "finished", restored_from="checkpoint_001_000000"))
    g = split(s, {1: reports([1.0, 2.0, 3.0]), 2: reports([6.0, 7.0, 8.0])}, now=99.0)
    adds_up(g, 9.0)
    assert g.complete and g.replayed_steps == 1


def test_a_restore_the_history_cannot_place_is_said_to_be_incomplete():
    s = state(attempt(1, 0.0, 5.0, "failed", failures=[failure(1, 5.0)]),
              attempt(2, 5.0, 9.0, "finished", restored_from="mine"))
    g = split(s, {1: reports([1.0, 2.0, 3.0]), 2: reports([6.0, 7.0, 8.0])}, now=99.0)
    adds_up(g, 9.0)
    assert not g.complete and g.replayed_s == 0
    assert any("no longer in the history" in line for line in describe(g))


def test_a_hang_is_charged_from_the_last_report_to_its_detection_then_a_restart():
    s = state(attempt(1, 0.0, 12.0, "failed", failures=[failure(1, 11.0, FailureKind.HANG)]),
              attempt(2, 12.0, 16.0, "finished"),
              hangs=[HangRecord(attempt=1, time=10.0, summary="stuck")])
    g = split(s, {1: reports([1.0, 2.0]), 2: reports([13.0, 15.0])}, now=99.0)
    adds_up(g, 16.0)
    assert g.hangs_s == 8.0
    assert g.restarts_s == 2.0 + 1.0  # detection to the attempt's end, then attempt 2 to its first report


def test_a_drain_is_charged_from_the_last_step_to_the_next_attempts_first_step():
    s = state(attempt(1, 0.0, 7.0, "failed", failures=[failure(1, 7.0, FailureKind.PREEMPTION)]),
              attempt(2, 7.0, 12.0, "finished", restored_from="checkpoint_001_000003"),
              drains=[DrainRecord(attempt=1, node_ids=["n"], reason="drain", message="", time=4.5, deadline=9.0)])
    g = split(s, {1: reports([1.0, 2.0, 3.0, 5.0]), 2: reports([9.0, 11.0])}, now=99.0)
    adds_up(g, 12.0)
    assert g.drains_s == 2.0 + 2.0  # the saving step's end to the attempt's end, and attempt 2's start-up
    assert g.productive_s == 4.0 + 2.0 and g.replayed_s == 0


def test_a_resize_is_a_restart_and_its_lost_steps_are_trained_again():
    ckpt = CheckpointRecord(checkpoint_dir="ck", seq=1, attempt=1, report_index=0, committed_at=1.0)
    s = state(attempt(1, 0.0, 4.0, "resized", workers=4), attempt(2, 4.0, 9.0, "finished", workers=2,
                                                                    restored_from="ck"),
              checkpoints=[ckpt], resizes=[ResizeRecord(attempt=2, from_workers=4, to_workers=2, reason="lost",
                                                        steps_lost=2, time=4.0)])
    g = split(s, {1: reports([1.0, 2.0, 3.0]), 2: reports([5.0, 6.0, 7.0, 8.0])}, now=99.0)
    adds_up(g, 9.0)
    assert g.restarts_s == 1.0 + 1.0
    assert g.replayed_steps == 1 and g.replayed_s == 1.0


def test_a_live_recovery_is_charged_from_the_step_thrown_away_to_the_state_received():
    # Steps report at 2, 4, 6; a rank dies at 6.5 (the step in flight is thrown away), the replacement holds the
    # state at 9, and the step trained again reports at 10.5.
    live = LiveRecoveryRecord(attempt=1, ranks=[1], cause="rank 1 killed", path="live", time=6.5, generation=1,
                              steps_lost=1, seconds=2.5)
    fell_back = LiveRecoveryRecord(attempt=1, ranks=[0], cause="rank 0 killed", path="restart", time=11.0)
    g = split(state(attempt(1, 0.0, 12.0, "finished"), live_recoveries=[live, fell_back]),
              {1: reports([2.0, 4.0, 6.0, 10.5, 11.5])}, now=99.0)
    adds_up(g, 12.0)
    assert g.live_recoveries_s == 9.0 - 6.0
    assert g.productive_s == 2.0 + 2.0 + 1.5 + 1.0  # the step after the recovery, from the state received
    assert g.steps == 4  # the recovery's interval still closes with a step that stayed


def test_a_live_recovery_across_reports_and_into_the_ending_is_carved_out_of_each():
    live = LiveRecoveryRecord(attempt=1, ranks=[1], cause="c", path="live", time=3.0, generation=1, steps_lost=1,
                              seconds=8.0)  # reports at 5 and 6 come from a rank not yet stopped: capped at each
    g = split(state(attempt(1, 0.0, 12.0, "finished"), live_recoveries=[live]), {1: reports([2.0, 5.0, 6.0])},
              now=99.0)
    adds_up(g, 12.0)
    assert g.live_recoveries_s == 11.0 - 2.0
    assert g.ending_s == 1.0 and g.productive_s == 0.0


def test_waiting_for_capacity_is_carved_out_of_the_piece_it_fell_in():
    s = state(attempt(1, 0.0, 6.0, "failed", failures=[failure(1, 6.0)]),
              attempt(2, 6.0, 20.0, "finished", waiting_since=6.5, capacity_at=14.0))
    g = split(s, {1: reports([1.0, 5.0]), 2: reports([16.0, 18.0])}, now=99.0)
    adds_up(g, 20.0)
    assert g.waiting_s == 7.5
    assert g.restarts_s == 1.0 + (16.0 - 6.0 - 7.5)


def test_a_run_still_going_counts_to_now_with_its_step_in_flight():
    s = state(attempt(1, 0.0, None, None), status="running")
    g = split(s, {1: reports([1.0, 2.0, 3.0])}, now=3.75)
    adds_up(g, 3.75)
    assert g.in_flight_s == 0.75 and g.productive_s == 2.0


def test_a_run_still_waiting_for_capacity_counts_the_wait_to_now():
    s = state(attempt(1, 0.0, None, None, waiting_since=1.0), status="waiting_for_capacity")
    g = split(s, {}, now=5.0)
    adds_up(g, 5.0)
    assert g.waiting_s == 4.0 and g.startup_s == 1.0


def test_the_time_between_two_drivers_is_not_held():
    s = state(attempt(1, 0.0, 4.0, "driver_lost"), attempt(2, 100.0, 104.0, "finished"))
    g = split(s, {1: reports([1.0, 2.0]), 2: reports([101.0, 103.0])}, now=200.0)
    adds_up(g, 8.0)
    assert g.restarts_s == 2.0 + 1.0


def test_a_run_with_no_attempt_held_nothing():
    g = split(state(status="initializing"), {}, now=5.0)
    assert g.held_s == 0 and g.fraction == 0
    assert describe(g) == ["goodput: nothing held yet"]


@pytest.mark.parametrize("part", PARTS)
def test_every_part_has_a_field_and_a_label(part):
    from outlast.storage.goodput import LABELS, Goodput

    assert f"{part}_s" in Goodput.__struct_fields__ and part in LABELS


def test_times_that_are_no_numbers_are_left_out_and_the_parts_still_add_up():
    s = state(attempt(1, 0.0, math.inf, "failed"), attempt(2, 5.0, 9.0, "finished"))
    g = split(s, {2: reports([6.0, 7.0, 8.0], stalls={1: math.nan, 2: math.inf})}, now=99.0)
    adds_up(g, 4.0)
    assert g.productive_s == 2.0 and g.checkpoint_stalls_s == 0.0
