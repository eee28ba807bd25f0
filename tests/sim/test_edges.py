"""The simulator one step off the tested path (`--edges`): failures during drains and grows, Ctrl+C and
lease loss at any instant, unkillable ranks, ranks with children, messages lost at a rank's exit, and
every state of the controller probed with every message. Each new invariant catches its bug put back, and
the seeds of the bugs these schedules found hold every invariant."""

from __future__ import annotations

import pytest

from outlast.sim.__main__ import run_many
from outlast.sim.run import Sim, run_seed
from outlast.sim.schedule import NEWER_DOCUMENTS, Fault, LoopSpec, Schedule, draw
from tests.sim.legacy import reinject_edge

# (bug put back, seed, edges): the new invariants catch each.
FIXED = [
    # a worker that SIGKILL cannot end kept its run restarting forever (the supervisor now gives it up and
    # its node drains itself)
    ("unkillable_waited_for", 23, True),
    ("unkillable_waited_for", 86, True),
    # a run's heartbeats that kept nothing alive: a node killed a live driver's workers for its "silence"
    ("heartbeat_ignored", 1, False),
    ("heartbeat_ignored", 2, False),
    # ranks lost with their fork server reported, their process groups not killed: their children lived on
    ("lost_groups_left", 14, True),
    ("lost_groups_left", 51, True),
]


@pytest.mark.parametrize(("bug", "seed", "edges"), FIXED, ids=[f"{b}-{s}" for b, s, _ in FIXED])
def test_an_edge_invariant_catches_its_bug_put_back(bug, seed, edges, monkeypatch):
    assert run_seed(seed, edges=edges).violations == []
    reinject_edge(bug, monkeypatch)
    assert run_seed(seed, edges=edges).violations != []


HOLD = [
    # A PreemptionQuery answered once the run is aborted (Ctrl+C), errored (lease lost) or finishing: the
    # controller's "a preemption decision without a preemption" AssertionError escaped (found by the probe).
    pytest.param(48, id="query-after-interrupt-48"),
    pytest.param(4, id="query-after-lease-loss-4"),
    pytest.param(73, id="query-while-finishing-73"),
    # A rank killed on a node that is not draining, while its attempt drains, was charged to
    # max_preemption_failures.
    pytest.param(11, id="failure-in-drain-charged-to-preemption-11"),
    # The last asynchronous checkpoint, whose files were all uploaded, lost at the end of the run when its
    # UploadDone died with the rank (the controller now looks for the files the upload began with itself).
    pytest.param(29, id="last-async-checkpoint-deleted-29"),
    pytest.param(42, id="last-async-checkpoint-uncommitted-42"),
    # A relaunched driver's spawn was taken at once on a node where the dead driver's rank, SIGKILLed, is stuck
    # in the kernel: the new attempt started beside it (the node now holds the spawn until it has exited).
    pytest.param(876, id="unkillable-placed-beside-876"),
    # A preempted attempt's teardown: a rank killed -9 by someone else before the stop's grace was over was taken
    # for the stop (1561), and a rank the stop could not end, on a node not drained, was charged to the drain (799).
    pytest.param(1561, id="sigkill-before-the-grace-taken-for-the-stop-1561"),
    pytest.param(799, id="unkillable-in-a-preempted-teardown-799"),
]


@pytest.mark.parametrize("seed", HOLD)
def test_an_edge_seed_of_a_fixed_bug_holds_every_invariant(seed):
    assert run_seed(seed, edges=True).violations == []


@pytest.mark.parametrize("seed", [1002, 1402])
def test_a_plain_schedule_charges_each_failure_to_its_causes_budget(seed):
    """The schedules without edge faults found it too, once the budget is checked."""
    assert Sim(draw(seed), edges=True).run().violations == []


def test_a_plain_schedule_556_keeps_its_last_checkpoint_when_slow_storage_reaches_a_clean_up_late():
    """Behind slow storage, the clean-up asked for at a restart ran once the next attempt was uploading."""
    assert Sim(draw(556), edges=True).run().violations == []


def drain_then_kill(gap_s: float) -> Schedule:
    """Node n0 drains (60 s), and `gap_s` later rank 1, on n1, which is not draining, is killed."""
    loop = LoopSpec(world_size=2, step_s=0.5, steps=40, asks=True, jit=True, return_on_notice=False, report_every=1,
                    checkpoint_every=4, sharded=False, done_lost=False, async_upload=False)
    return Schedule(seed=1, loop=loop, nodes=3, cpus_per_node=1, strategy="SPREAD", max_failures=0,
                    num_to_keep=None, max_delay_s=0.002, storage_latency_s=0.0, refuse_deletes=False,
                    faults=[Fault(5.0, "drain", 0, 60.0), Fault(5.0 + gap_s, "kill_worker", 1)])


def test_a_rank_killed_on_a_node_not_draining_during_a_drain_is_charged_to_max_failures():
    sim = Sim(drain_then_kill(0.2), edges=True)
    out = sim.run()
    assert out.violations == []
    assert out.status == "errored"  # max_failures=0: the kill ends the run
    assert sim.final_book().state.failure_counts.get("worker") == 1


def test_a_kill_after_the_drain_has_settled_is_charged_to_max_failures():
    """The edge of the one above: once the drained attempt has ended, a kill is the next attempt's failure."""
    sim = Sim(drain_then_kill(0.5), edges=True)
    out = sim.run()
    assert out.violations == [] and out.status == "errored"
    assert sim.final_book().state.failure_counts == {"preemption": 1, "worker": 1}


def test_a_rank_killed_during_a_grow_is_charged_to_max_failures_and_the_run_still_grows():
    from tests.sim.test_elastic import schedule

    # A node joins a run of 3 (of 4): the failure waits for the grow's notice and strikes 10 ms into it.
    sim = Sim(schedule([Fault(5.0, "add_node"), Fault(5.0, "arm_in_grow", 1, duration_s=0.01, deadline_s=0.0)],
                       nodes=3, world=4, low=2))
    out = sim.run()
    state = sim.final_book().state
    assert out.violations == [] and out.status == "finished"
    assert sim.facts["failures_in_grows"] == 1
    assert state.failure_counts == {"worker": 1}
    assert [(r.from_workers, r.to_workers) for r in state.resizes] == [(3, 4)]


def newer_while_dead(which: str) -> Schedule:
    """The driver dies at 6 s (a checkpoint committed by then), and a newer outlast rewrites `which` at 7 s."""
    loop = LoopSpec(world_size=2, step_s=0.5, steps=40, asks=True, jit=True, return_on_notice=False, report_every=1,
                    checkpoint_every=4, sharded=False, done_lost=False, async_upload=False)
    return Schedule(seed=1, loop=loop, nodes=3, cpus_per_node=1, strategy="SPREAD", max_failures=0,
                    num_to_keep=None, max_delay_s=0.002, storage_latency_s=0.0, refuse_deletes=False,
                    faults=[Fault(6.0, "driver_death"), Fault(7.0, "newer_document", NEWER_DOCUMENTS.index(which))])


@pytest.mark.parametrize("which", NEWER_DOCUMENTS)
def test_a_run_a_newer_outlast_wrote_is_refused_by_the_next_driver_which_changes_nothing(which):
    sim = Sim(newer_while_dead(which), edges=True)
    out = sim.run()
    assert out.violations == [] and out.status == "refused"
    assert sim.facts["refused_as_newer"] == 1 and list(sim.newer.values()) == [which]
    assert "written by a newer outlast" in sim.refused and "upgrade outlast" in sim.refused


def test_a_newer_lease_read_as_this_versions_is_caught(monkeypatch):
    import outlast.storage.run_store as run_store

    monkeypatch.setattr(run_store, "LEASE_VERSION", 99)  # the version check put back out
    out = Sim(newer_while_dead("lease"), edges=True).run()
    assert any("opened the run although a newer outlast wrote its lease" in v for v in out.violations)


# Minutes of CPU, beside the tests of real processes (scripts/test): more than pytest's 300 s.
@pytest.mark.timeout(1200)
def test_three_hundred_edge_schedules_hold_every_invariant_and_reach_every_new_fault():
    summary = run_many(0, 300, jobs=1, edges=True)
    assert summary["schedules"] == 300
    assert summary["violations"] == 0, summary
    totals = summary["totals"]
    for fact in ("interrupts", "lease_losses", "unkillable_ranks", "children_started", "uploads_lost_at_exit",
                 "failures_in_drains", "states_probed", "newer_documents", "refused_as_newer"):
        assert totals[fact] > 0, (fact, totals)
    assert summary["outcomes"].get("finished", 0) > 100 and summary["outcomes"].get("aborted", 0) > 10
