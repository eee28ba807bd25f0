import pytest

from bench.lib import live_kills
from bench.lib.live_kills import PHASES, plan


def test_a_plan_takes_the_phases_in_turn_one_kill_a_window_and_checkpoint_kills_on_rank_zero_at_a_checkpoint():
    kills = plan(24, 20, 2, seed=3, first=20, ckpt_every=10)
    assert [k.phase for k in kills] == list(PHASES) * 4
    for k in kills:
        assert 20 + 20 * k.index <= k.step < 40 + 20 * k.index
        assert 0 <= k.fraction <= 1
        if k.phase == "checkpoint":
            assert k.rank == 0 and (k.step + 1) % 10 == 0
        else:
            assert (k.step + 1) % 10 != 0
    # Each phase that any rank can hit falls on both ranks.
    for phase in PHASES[:-1]:
        assert {k.rank for k in kills if k.phase == phase} == {0, 1}


def test_a_plan_is_the_same_for_the_same_seed():
    assert plan(10, 5, 3, seed=7, phases=PHASES[:-1]) == plan(10, 5, 3, seed=7, phases=PHASES[:-1])


@pytest.mark.parametrize("args", [dict(ckpt_every=0), dict(ckpt_every=30), dict(phases=("forward", "sideways"))])
def test_a_plan_refuses_what_it_cannot_carry_out(args):
    with pytest.raises(ValueError):
        plan(4, 20, 2, seed=1, **args)


def ev(kind, t, pid, rank=0, **kw):
    return {"ev": kind, "t": t, "pid": pid, "rank": rank, "attempt": kw.pop("attempt", 1), **kw}


def test_live_losses_count_the_steps_each_survivor_threw_away_between_one_kill_and_the_next():
    events = [
        ev("start", 0.0, 10, rank=0, step=0), ev("start", 0.0, 11, rank=1, step=0),
        ev("kill", 1.0, 10, rank=0, index=0, step=5, phase="forward", hit_phase="forward"),
        ev("thrown", 1.2, 11, rank=1, step=5),
        ev("start", 1.3, 12, rank=0, step=5),
        ev("step", 1.4, 11, rank=1, step=5), ev("step", 1.41, 12, rank=0, step=5),
        ev("kill", 2.0, 11, rank=1, index=1, step=9, phase="report", hit_phase="report"),
        ev("thrown", 2.2, 12, rank=0, step=10), ev("thrown", 2.5, 12, rank=0, step=10),
        ev("start", 2.3, 13, rank=1, step=10),
        ev("step", 2.6, 13, rank=1, step=10),
    ]
    first, second = live_kills.live_losses(events)
    assert (first["steps_lost"], first["kill_to_training_s"], first["survivors_agree"]) == (1, 0.41, True)
    assert first["survivor_pids_kept"]
    # Rank 0's process 12 applied no step after the second kill: not seen to go on.
    assert not second["survivor_pids_kept"]
    # The same step thrown twice (a generation that broke while forming) is one step lost.
    assert (second["steps_lost"], second["kill_to_training_s"]) == (1, 0.6)
    assert live_kills.by_phase([first, second]) == {"forward": {"1": 1}, "report": {"1": 1}}


def test_restart_losses_are_the_steps_since_the_restored_checkpoint_and_the_one_in_flight():
    events = [
        ev("start", 0.0, 10, step=0), *[ev("step", 0.1 * s, 10, step=s) for s in range(13)],
        ev("kill", 1.35, 10, index=0, step=13, phase="forward", hit_phase="forward"),
        ev("start", 2.0, 20, step=10, attempt=2), ev("step", 2.1, 20, step=10, attempt=2),
    ]
    [k] = live_kills.restart_losses(events)
    # Steps 10, 11, 12 applied and trained again, 13 in flight.
    assert (k["steps_lost"], k["restored_step"], k["kill_to_training_s"]) == (4, 9, 0.75)


def test_a_restart_that_never_came_is_unknown_not_zero():
    events = [ev("start", 0.0, 10, step=0), ev("kill", 1.0, 10, index=0, step=3, phase="forward",
                                                hit_phase="forward")]
    [k] = live_kills.restart_losses(events)
    assert k["steps_lost"] is None
    assert live_kills.counts([k["steps_lost"], 0, 1, 2, 7]) == {"0": 1, "1": 1, "2+": 2, "unknown": 1}


def test_efficiency_and_its_bound():
    assert live_kills.efficiency(20.0, 25.0) == 0.8
    assert live_kills.efficiency_bound(5, 1) == 0.8333
    span = live_kills.training_span([ev("step", 1.0, 10, step=0), ev("step", 3.5, 11, step=1),
                                     ev("step", 9.0, 12, rank=1, step=1)])
    assert span == {"steps": 2, "last_step": 1, "wall_s": 2.5}
