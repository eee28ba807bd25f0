from bench.lib import reread


def start(attempt, restored):
    return {"event": "start", "attempt": attempt, "rank": 0, "restored_step": restored}


def used(attempt, step, epoch, rows, time=0.0):
    return {"event": "used", "attempt": attempt, "rank": 0, "step": step, "epoch": epoch, "rows": rows,
            "time": time}


def test_a_step_after_the_one_the_next_attempt_restored_does_not_count():
    events = [start(1, None), used(1, 0, 0, [0, 1]), used(1, 1, 0, [2, 3]), used(1, 2, 0, [4, 5]),
              start(2, 0), used(2, 1, 0, [2, 3]), used(2, 2, 0, [4, 5])]
    assert [(e["attempt"], e["step"]) for e in reread.counted(events)] == [(1, 0), (2, 1), (2, 2)]
    assert reread.used_again(reread.uses_by_epoch(events)) == {0: 0}


def test_an_attempt_that_started_afresh_discards_every_step_before_it():
    events = [start(1, None), used(1, 0, 0, [0, 1]), start(2, None), used(2, 0, 0, [0, 1])]
    assert [e["attempt"] for e in reread.counted(events)] == [2]


def test_an_epoch_read_again_from_its_start_counts_each_use_past_a_rows_first():
    # Ray's way: restored at step 1 (epoch 0, 2 steps in), the epoch's pass starts over at its first rows.
    events = [start(1, None), used(1, 0, 0, [0, 1]), used(1, 1, 0, [2, 3]),
              start(2, 1), used(2, 2, 0, [0, 1]), used(2, 3, 0, [2, 3]), used(2, 4, 0, [4, 5]),
              used(2, 5, 1, [0, 1])]
    uses = reread.uses_by_epoch(events)
    assert uses[0] == {0: 2, 1: 2, 2: 2, 3: 2, 4: 1, 5: 1}
    assert reread.used_again(uses) == {0: 4, 1: 0}


def test_the_derived_figure_is_the_epochs_rows_up_to_each_restored_step_and_nothing_at_an_epochs_end():
    # 10 steps an epoch of 6 rows a step: step 3 is 4 steps into epoch 0, step 19 ends epoch 1, 22 is 3 in.
    assert reread.derived_again([3, 19, 22], steps_per_epoch=10, rows_per_step=6) == {0: 24, 2: 18}


def test_two_restores_in_one_epoch_read_again_less_than_derived_when_the_steps_run_on():
    # Restores at steps 1 and 3; on Ray the second lands 2 steps into the epoch's second pass, not 4 in.
    events = [start(1, None), used(1, 0, 0, [0]), used(1, 1, 0, [1]),
              start(2, 1), used(2, 2, 0, [0]), used(2, 3, 0, [1]),
              start(3, 3), *[used(3, 4 + i, 0, [i]) for i in range(5)]]
    assert reread.used_again(reread.uses_by_epoch(events)) == {0: 4}
    assert reread.derived_again([1, 3], steps_per_epoch=5, rows_per_step=1) == {0: 6}


def test_a_restart_lasts_from_the_kill_to_the_next_attempts_first_step():
    events = [start(1, None), used(1, 0, 0, [0], time=1.0), {"event": "kill", "attempt": 1, "step": 1, "time": 2.0},
              start(2, 0), used(2, 1, 0, [1], time=14.5), used(2, 2, 0, [2], time=15.0)]
    assert reread.restart_seconds(events) == [12.5]
