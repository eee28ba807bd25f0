"""Live recovery in the simulator (outlast/sim/live.py): ranks that run the real step commit against the real
controller, killed at every point of a step, keep every invariant over a thousand schedules, and each fault the
simulator found, put back, fails its seed."""

from __future__ import annotations

from collections import Counter

import pytest

from outlast.controller import live_steps
from outlast.controller.commit import CommitTracker
from outlast.protocol.membership import Membership
from outlast.sim import live as sim_live
from outlast.sim.live import POINTS
from outlast.sim.run import run_seed
from outlast.sim.schedule import SHARD_POINTS
from outlast.train.live.live_rank import LiveRank

SCHEDULES = 1000


def test_a_thousand_live_schedules_keep_every_invariant_and_reach_every_point():
    facts: Counter[str] = Counter()
    for seed in range(SCHEDULES):
        out = run_seed(seed, live=True)
        assert out.violations == [], f"seed {seed}: {out.violations}"
        facts.update({k: v for k, v in out.facts.items() if k.startswith("live_")})
        facts[out.status] += 1
    # Every point of a step was struck, many times over.
    for point in POINTS + SHARD_POINTS:
        assert facts[f"live_kill_{point}"] >= 10, (point, facts)
    # The states worth reaching: recoveries that went live, some widened by a death in their transfer, some shrunk,
    # and each kind of fallback: no rank left holding the state, and replacements dying past the bound.
    assert facts["live_recovered"] >= 200 and facts["live_widened"] >= 20
    # Elastic runs that lost a node with no room elsewhere, shrunk live (one step thrown away each, at most).
    assert facts["live_shrunk"] >= 5
    assert facts["live_fallback_no_holder"] >= 50 and facts["live_fallback_transfer_bound"] >= 10
    # Runs that split the optimizer's state in shards: recovered live, each joiner from a holder of its shard, and
    # fallen back when every holder of a shard was lost.
    assert facts["live_sharded"] >= 200 and facts["live_sharded_recovered"] >= 100
    assert facts["live_several_senders"] >= 20  # joiners of different shards in one recovery, a sender each
    assert facts["live_fallback_unheld_shard"] >= 50
    assert facts["finished"] >= 0.8 * SCHEDULES


def test_a_live_schedule_is_deterministic_for_its_seed():
    assert run_seed(7, live=True) == run_seed(7, live=True)


def _old_skip_to(self, rank: int, index: int) -> None:
    if 0 <= rank < self.world_size and index > self.reports[rank]:
        self.reports[rank] = index


@pytest.mark.parametrize("fault,seed", [
    # the ranks of an attempt that restored a checkpoint agreed on step -1 and trained from step 0 again
    ("resume_at", 7),
    ("resume_at", 10),
    # a replacement's skipped report left the count of reports made behind: no later checkpoint settled
    ("skip_to", 180),
    # a rank that died before reporting a committed step held up the checkpoint a survivor waited on
    ("replaced", 15),
    ("replaced", 40),
    # a replacement restored the attempt's checkpoint, deleted by retention since
    ("replacement_restores", 715),
    # a rank lost in a sharded run's gather after a committed step: its replacement took a count of reports that
    # lacked that step's report, and the checkpoint a survivor waited on never settled
    ("reports_after_gather", 0),
])
def test_each_fault_found_put_back_fails_its_seed(monkeypatch, fault, seed):
    assert run_seed(seed, live=True).violations == []
    if fault == "resume_at":
        monkeypatch.setattr(LiveRank, "resume_at", lambda self, step: None)
    elif fault == "skip_to":
        monkeypatch.setattr(CommitTracker, "replaced", lambda self, rank: [])
        monkeypatch.setattr(CommitTracker, "skip_to", _old_skip_to)
    elif fault == "reports_after_gather":
        monkeypatch.setattr(sim_live, "reports_after_gather", lambda own, counts, took_state: own)
    elif fault == "replaced":
        monkeypatch.setattr(CommitTracker, "replaced", lambda self, rank: [])
    else:
        monkeypatch.setattr(live_steps, "replacement", lambda c, a, rank, env: live_steps.spawns.spawn(
            c, a, a.placement[rank], [a.specs[rank]], env))
    assert run_seed(seed, live=True).violations != []


def test_a_joiner_sent_another_shard_s_state_fails_its_seed(monkeypatch):
    # Seed 0 is sharded: rank 1 (shard 1 of 2) is lost in a gather. Sent from the lowest rank that kept the state,
    # whatever its shard, its replacement takes shard 0's.
    assert run_seed(0, live=True).violations == []
    sender = Membership.sender
    monkeypatch.setattr(Membership, "sender", lambda self, joiner, shards=1: sender(self, joiner, 1))
    assert run_seed(0, live=True).violations != []
