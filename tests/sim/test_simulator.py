"""The deterministic simulator: thousands of schedules hold every invariant, and each bug it guards
against, put back into the controller, fails its regression seed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from outlast.sim.__main__ import run_many
from outlast.sim.run import run_seed
from tests.sim.legacy import reinject, reinject_tier

# (bug, seed): the seed's schedule runs into the bug; with the bug put back the simulator reports it. Every seed
# runs on the one node model, the agent's real core (outlast/sim/agent_node.py).
REGRESSIONS = [
    # issue 8 (a): a notice mid-step of a slow loop was decided at the stale 2^20 horizon
    ("a", 28),  # 3.5 s steps
    ("a", 145),  # 4.2 s steps, 4 ranks, the second attempt
    # found by the simulator in the first fix of (a): a live grant of many calls was trusted as a bound, and a
    # fast loop that slowed down after it (a report() waiting on an asynchronous upload) saw the notice late
    ("live_grants_trusted", 791),
    ("live_grants_trusted", 899),
    # issue 8 (b): ranks that returned during a preemption, a last message missing, then the deadline: a
    # timer fired ALL_FINISHED in whatever state the run had moved on to
    ("b", 1355),
    ("b", 2448),
    # issue 8 (c): a bucket that refuses deletes, with num_to_keep
    ("c", 3),
    ("c", 36),  # 14 until retention kept the checkpoint a new attempt restores: its delete is no longer asked then
    # found by the simulator: a drained node going away at once (deadline 0 s, or a notice that came after the
    # failure it caused) was charged to max_failures
    ("drain_deadline_charged", 1958),
    ("drain_deadline_charged", 415),
    # found by the simulator: a node refusing a spawn made every rank that had not said hello yet, on any node,
    # count as never started, and the next attempt started beside them
    ("refusal_takes_other_nodes", 838),
    ("refusal_takes_other_nodes", 1645),
    # found by the simulator in the first fix of the above: a second refusal, arriving once the first had
    # ended the attempt, was dropped, and the attempt waited forever for ranks that never started
    ("second_refusal_dropped", 12877),
    # found with the agent's supervisor on the nodes: a node whose agent was gone stayed lost to the run after
    # the agent was started again (same node id, new pid), so ranks placed there were lost at once, again and again
    ("agent_gone_for_good", 212),
    ("agent_gone_for_good", 140),
    # ... and the fix's first form: an agent restarted while the run had no ranks there left the gone mark, and
    # the next ranks placed there were taken for lost while they lived
    ("agent_gone_for_good", 552),
    # a persistent agent started again within the node timeout answered the heartbeats with its new pid: the
    # old agent's workers were gone, nobody reported them, and the run waited for them forever
    ("restarted_agent_unnoticed", 529),
    ("restarted_agent_unnoticed", 283),
    # ranks placed with a node table older than the node's agent went to the agent started since at its address;
    # the gone agent's loss then took them for lost while they lived, and the next attempt started beside them
    ("spawn_to_any_agent", 5663),
    # a drain between a spawn and the fork server's report of its forks did not reach the run: the agent told
    # only the runs whose workers it had seen born, and the run heard of the drain late or from its loss
    ("drain_misses_pending_forks", 54990),
]
# Found in the schedules with memory tiers on the nodes (outlast/sim/tier.py), in runs that keep checkpoints in
# memory only.
TIER = [
    # a relaunched driver adopted a manifest the run state did not name yet as durable and held nowhere: its
    # restore pulled nothing, and every rank's restore failed for want of the others' files
    ("adopted_manifest_loses_level", 1861),
    # the copies a node pulled for a restore were not counted as held: once the first holders were gone, a
    # checkpoint still in memory there was skipped as held nowhere
    ("pulled_copies_unrecorded", 53),
]
# Seeds of bugs fixed where no single piece can be put back: each must hold every invariant.
HOLD = [
    5686,  # a refused spawn left the old agent's pid as the one the node's ranks were on: the next ranks, on the
    #        new agent, were taken for lost at its first answer
    9609,  # a rank that ignored SIGTERM and died of the grace's SIGKILL while its attempt restarted was charged
    #        to max_failures
    4586,  # a node whose agent was gone (heard of before the table caught up) was offered to the next attempt
    8271,
]
TIER_HOLD = [
    1114,  # a pull to a node whose own copy had rotted answered "already held" (tier_work.py, whose sequence the
    #        simulator plays; tests/unit/test_tier_store.py fails with it put back), and every rank there failed
]
@pytest.mark.parametrize(("bug", "seed"), REGRESSIONS, ids=[f"{b}-{s}" for b, s in REGRESSIONS])
def test_a_regression_seed_fails_with_its_bug_put_back_and_passes_with_the_fix(bug, seed, monkeypatch):
    assert run_seed(seed).violations == []
    reinject(bug, monkeypatch)
    assert run_seed(seed).violations != []


@pytest.mark.parametrize(("bug", "seed"), TIER, ids=[f"{b}-{s}" for b, s in TIER])
def test_a_memory_tier_regression_seed_fails_with_its_bug_put_back_and_passes_with_the_fix(bug, seed, monkeypatch):
    assert run_seed(seed, tier=True).violations == []
    reinject_tier(bug, monkeypatch)
    assert run_seed(seed, tier=True).violations != []


@pytest.mark.parametrize("seed", HOLD)
def test_a_seed_of_a_fixed_bug_holds_every_invariant(seed):
    assert run_seed(seed).violations == []


@pytest.mark.parametrize("seed", TIER_HOLD)
def test_a_memory_tier_seed_of_a_fixed_bug_holds_every_invariant(seed):
    assert run_seed(seed, tier=True).violations == []


def test_a_pull_whose_holders_all_failed_asks_a_holder_whose_agent_came_back_meanwhile():
    # Seed 998: the only holder reachable at placement has a corrupt copy, and the other holder's agent, down then,
    # is back with its copies by the time that pull fails. The pull asks it; it once gave up and the restore failed.
    assert run_seed(998, tier=True).violations == []


@pytest.mark.timeout(1200)
def test_memory_tier_schedules_hold_every_invariant_and_reach_the_interesting_states():
    summary = run_many(0, 500, jobs=2, tier=True)
    assert summary["violations"] == 0, summary
    totals = summary["totals"]
    assert totals["restores_from_memory"] > 100 and totals["evictions"] > 100
    assert totals["copies_corrupted"] > 50 and totals["holders_lost"] > 30


# A minute of CPU, beside the tests of real processes (scripts/test): more than pytest's 300 s under load.
@pytest.mark.timeout(1200)
def test_two_thousand_schedules_hold_every_invariant_and_reach_the_interesting_states():
    # A longer sweep is `python -m outlast.sim --seeds N --jobs 2` (about 230 schedules a second a core).
    summary = run_many(0, 2_000, jobs=2)
    assert summary["schedules"] == 2_000
    assert summary["violations"] == 0, summary
    totals = summary["totals"]
    assert totals["preempted_attempts"] > 200  # drains that reached a run
    assert totals["ranks_told"] > 200  # ranks that saw a notice
    assert totals["driver_launches"] > 2_100  # relaunched drivers
    assert summary["outcomes"].get("finished", 0) > 1_600
    # outlast's own processes die too: fork servers, embedded agents (a new node), persistent agents (restarted)
    assert totals["fork_server_deaths"] > 200
    assert totals["agent_deaths"] > 100
    assert totals["agent_restarts"] > 200


def test_a_seed_replays_to_the_same_trace():
    first, second = run_seed(1215, trace=True), run_seed(1215, trace=True)
    assert first.trace == second.trace and len(first.trace) > 50


def test_the_command_prints_one_json_line_and_replays_a_seed():
    out = subprocess.run([sys.executable, "-m", "outlast.sim", "--seeds", "30", "--jobs", "1"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["schedules"] == 30 and summary["violations"] == 0 and summary["schedules_per_s"] > 0
    replay = subprocess.run([sys.executable, "-m", "outlast.sim", "--seed", "7"], capture_output=True, text=True,
                            timeout=120)
    assert replay.returncode == 0
    assert "driver1 launched" in replay.stdout and json.loads(replay.stdout.splitlines()[-1])["seed"] == 7
