"""Elastic runs in the simulator: shrink on a lost or drained node, grow on a joined one, a resize during a
preemption and a resize racing a failure, each against the invariants and the run's recorded history."""

from __future__ import annotations

import dataclasses

import pytest

from outlast.protocol.kinds import FailureKind
from outlast.sim.run import Sim
from outlast.sim.schedule import Fault, LoopSpec, Schedule


def schedule(faults, *, world=4, low=2, nodes=4, steps=40, step_s=0.5, interval=0.0, jit=True, seed=1,
             checkpoint_every=4, max_failures=3) -> Schedule:
    loop = LoopSpec(world_size=world, step_s=step_s, steps=steps, asks=jit, jit=jit, return_on_notice=False,
                    report_every=1, checkpoint_every=checkpoint_every, sharded=False, done_lost=False,
                    async_upload=False)
    return Schedule(seed=seed, loop=loop, nodes=nodes, cpus_per_node=1, strategy="PACK", max_failures=max_failures,
                    num_to_keep=None, max_delay_s=0.002, storage_latency_s=0.0, refuse_deletes=False, faults=faults,
                    min_workers=low, resize_interval_s=interval)


def run(s: Schedule):
    sim = Sim(s)
    out = sim.run()
    assert out.violations == [], out.violations
    book = sim.final_book()
    assert book is not None
    return out, book.state


def test_a_lost_node_shrinks_the_run_at_once_on_what_is_left_charging_no_failure():
    out, state = run(schedule([Fault(5.0, "lose_node", target=3)]))
    assert out.status == "finished"
    assert [(r.from_workers, r.to_workers) for r in state.resizes] == [(4, 3)]
    assert "lost" in state.resizes[0].reason
    assert state.resizes[0].steps_lost <= 4  # at most a checkpoint interval (4 reports)
    assert state.failure_counts.get("worker", 0) == 0
    assert [a.workers for a in state.attempts] == [4, 3]


def test_a_drain_with_nowhere_to_go_shrinks_right_after_the_just_in_time_checkpoint_losing_no_step():
    out, state = run(schedule([Fault(5.0, "drain", target=3, deadline_s=60.0)]))
    assert out.status == "finished"
    assert [(r.from_workers, r.to_workers) for r in state.resizes] == [(4, 3)]
    assert "drained" in state.resizes[0].reason and state.resizes[0].steps_lost == 0
    assert state.attempts[1].started_at - state.attempts[0].started_at < 60.0  # not the drain's deadline
    assert not state.failure_counts.get("worker") and not state.failure_counts.get("preemption")


def test_below_min_the_run_waits_for_capacity_instead_of_shrinking_further():
    out, state = run(schedule([Fault(5.0, "lose_node", target=3), Fault(5.0, "lose_node", target=2),
                               Fault(5.0, "lose_node", target=1), Fault(15.0, "add_node")]))
    assert out.status == "finished"
    assert all(r.to_workers >= 2 for r in state.resizes)
    assert state.attempts[1].workers == 2


def test_a_node_that_joins_grows_the_run_through_the_notice_losing_no_step():
    out, state = run(schedule([Fault(5.0, "add_node"), Fault(5.0, "add_node")], nodes=2))
    assert out.status == "finished"
    assert state.attempts[0].workers == 2
    assert [(r.from_workers, r.to_workers) for r in state.resizes] == [(2, 4)]
    assert state.resizes[0].reason.startswith("grow") and state.resizes[0].steps_lost == 0
    assert not state.failure_counts


def test_growth_waits_out_the_least_interval_between_resizes():
    out, state = run(schedule([Fault(1.0, "add_node")], nodes=2, interval=10.0, steps=60))
    assert out.status == "finished"
    assert [(r.from_workers, r.to_workers) for r in state.resizes] == [(2, 3)]
    assert state.resizes[0].time - state.attempts[0].started_at >= 10.0


def test_a_loop_that_never_saves_is_not_grown_and_loses_nothing():
    out, state = run(schedule([Fault(3.0, "add_node")], nodes=2, jit=False, checkpoint_every=1000, steps=20))
    assert out.status == "finished"
    assert state.resizes == [] and len(state.attempts) == 1


def test_a_node_joining_during_a_preemption_is_used_by_the_restart():
    out, state = run(schedule([Fault(5.0, "drain", target=1, deadline_s=60.0), Fault(5.0, "add_node"),
                               Fault(5.0, "add_node")], nodes=3, world=4, low=2))
    assert out.status == "finished"
    assert state.attempts[0].workers == 3
    assert state.attempts[-1].workers == 4


def test_a_failure_racing_a_grow_is_charged_as_a_failure_and_the_run_still_grows():
    out, state = run(schedule([Fault(5.0, "add_node"), Fault(6.2, "kill_worker", target=1)], nodes=2,
                              step_s=2.0, steps=15))
    assert out.status == "finished"
    assert state.failure_counts.get("worker") == 1
    assert state.attempts[-1].workers == 3


@pytest.mark.parametrize("seed", range(40))
def test_elastic_schedules_with_random_faults_hold_every_invariant(seed):
    import random
    rng = random.Random(seed)
    kinds = ["lose_node", "drain", "add_node", "kill_worker", "add_node"]
    faults = sorted((Fault(rng.uniform(0.0, 25.0), rng.choice(kinds), target=rng.randrange(6),
                           deadline_s=rng.choice([None, 0.0, 5.0, 30.0])) for _ in range(rng.randint(1, 4))),
                    key=lambda f: f.at)
    out, state = run(schedule(faults, nodes=rng.choice([2, 3, 4]), low=rng.choice([1, 2]), seed=seed,
                              interval=rng.choice([0.0, 5.0]), jit=rng.random() < 0.8, max_failures=-1))
    assert out.status in ("finished", "errored")
    for r in state.resizes:
        assert (r.from_workers, r.to_workers) != (0, 0) and 1 <= r.to_workers <= 4


def test_a_wedged_rank_is_found_explained_from_every_ranks_stacks_and_restarted_as_a_failure():
    s = schedule([Fault(6.0, "hang", target=1)], world=2, low=0, nodes=2, steps=30)
    s = dataclasses.replace(s, hang_timeout_s=20.0, min_workers=0)
    out, state = run(s)
    assert out.status == "finished"
    assert state.failure_counts == {"worker": 1}
    (hang,) = state.hangs
    assert "made no progress for" in hang.summary and "hang_timeout_s=20" in hang.summary
    assert "rank 1 is in sleep_forever (sim user code), while rank 0 waits in all_reduce (sim)" in hang.summary
    assert sorted(r for g in hang.stacks for r in g.ranks) == [0, 1]
    assert state.attempts[0].failures[0].kind is FailureKind.HANG
    assert hang.time - state.attempts[0].started_at >= 20.0


@pytest.mark.parametrize(("step_s", "steps"), [(0.02, 400), (60.0, 8), (250.0, 4)])
def test_neither_a_fast_nor_a_slow_loop_is_taken_for_hung_by_the_adaptive_timeout(step_s, steps):
    s = schedule([], world=2, low=0, nodes=2, steps=steps, step_s=step_s)
    s = dataclasses.replace(s, hang_timeout_s=None, min_workers=0)
    out, state = run(s)
    assert out.status == "finished" and state.hangs == [] and len(state.attempts) == 1


# Minutes of CPU, beside the tests of real processes (scripts/test): more than pytest's 300 s.
@pytest.mark.timeout(1200)
def test_two_thousand_elastic_schedules_hold_every_invariant_and_both_shrink_and_grow():
    from outlast.sim.__main__ import run_many

    summary = run_many(0, 2_000, jobs=2, elastic=True)
    assert summary["violations"] == 0, summary
    totals = summary["totals"]
    assert totals["grows"] > 25 and totals["resizes"] - totals["grows"] > 25, totals  # grew, and shrank
    assert summary["outcomes"].get("finished", 0) > 1_600
