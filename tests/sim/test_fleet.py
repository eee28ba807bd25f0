"""The fleet command at a small size: every variant's invariants hold, and a seed gives the same run."""

from __future__ import annotations

import copy
import functools
import json
import random
from dataclasses import replace

import pytest

from outlast.sim.__main__ import main
from outlast.sim.fleet import WALL0, FleetConfig, Mechanisms, simulate
from outlast.sim.fleet_command import run
from outlast.sim.fleet_invariants import violations
from outlast.sim.interruptions import LLAMA3_PLANNED, LLAMA3_UNEXPECTED, Effect, Interruption, by_mttf, llama3

SMALL = FleetConfig(nodes=16, days=1.0, spares=64)  # never short of a spare: "all on" never waits


def small(seed: int = 1) -> dict:
    return copy.deepcopy(_small(seed))


@functools.lru_cache(maxsize=None)
def _small(seed: int) -> dict:
    return run(SMALL, seed, "llama3", mttf_hours=8.0, drains_per_day=6.0, cost=False)


def test_every_variant_keeps_the_invariants_with_every_kind_of_interruption_striking() -> None:
    out = small()
    assert out["violations"] == []
    assert len(out["variants"]) == 7
    for v in out["variants"]:
        assert set(v["struck"]) == {e.value for e in Effect}, v["struck"]
        assert v["budgets"]["worker"] == v["struck"]["rank_dies"] + v["struck"]["node_lost"] + v["struck"]["hang"]
        assert v["budgets"]["preemption"] == v["struck"]["drain"]
        assert sum(v["parts_s"].values()) == pytest.approx(v["held_s"], abs=1.0)
        assert v["held_s"] == pytest.approx(86_400, abs=1.0)
        live = v["live_recoveries"]
        if v["live_recovery"]:
            # LiveRun answers every death: a rank's on its node, and a lost node's ranks, together, on a spare free
            # when the loss is seen (replaced, or a restart: before the live group formed, no spare free); a hang
            # or a drain is no death.
            assert live["live"] + live["restart"] == v["struck"]["rank_dies"] + v["struck"]["node_lost"]
            assert 0 < live["live"] <= v["struck"]["rank_dies"] + v["struck"]["node_lost"]
            # A resize is an attempt of its own, but a live one (an elastic run's shrink, or its grow back).
            assert v["attempts"] == 1 + v["budgets"]["worker"] + v["budgets"]["preemption"] - live["live"] + v[
                "resizes"] - v["live_resizes"]
        else:
            assert live == {"live": 0, "restart": 0}


def test_a_seed_gives_the_same_run_and_another_seed_another() -> None:
    first, again, other = small(1), run(SMALL, 1, "llama3", 8.0, 6.0, cost=False), small(2)
    for out in (first, again, other):
        out.pop("simulation"), out.pop("elapsed_s")
        for v in out["variants"]:
            v.pop("sim_cpu_s"), v.pop("decisions_cpu_s")
    assert json.dumps(first) == json.dumps(again)
    assert json.dumps(first) != json.dumps(other)


def test_each_mechanism_is_worth_something_on_its_own() -> None:
    by = {v["mechanisms"]: v for v in small()["variants"]}
    on = by["all on"]["goodput"]
    assert by["off: memory_tier"]["parts_s"]["replayed"] > by["all on"]["parts_s"]["replayed"]
    assert by["off: jit_drain"]["parts_s"]["replayed"] > by["all on"]["parts_s"]["replayed"]
    assert by["all off"]["parts_s"]["waiting"] > 0 == by["all on"]["parts_s"]["waiting"]
    assert by["off: live_recovery"]["parts_s"]["restarts"] > by["all on"]["parts_s"]["restarts"]
    assert by["all on"]["parts_s"]["live_recoveries"] > 0 == by["off: live_recovery"]["parts_s"]["live_recoveries"]
    assert by["off: live_recovery"]["goodput"] < on
    assert all(v["goodput"] <= on for v in by.values())


def test_the_llama3_mix_at_its_own_size_is_the_papers_counts() -> None:
    events = llama3(2048, 54.0, random.Random(7))
    counts: dict[str, int] = {}
    for e in events:
        counts[e.cause] = counts.get(e.cause, 0) + 1
    assert counts == {**{c: n for c, n, _ in LLAMA3_UNEXPECTED}, "planned maintenance": LLAMA3_PLANNED}
    assert len(events) == 466 and all(0 <= e.at_s < 54 * 86_400 and 0 <= e.node < 2048 for e in events)


def test_a_live_recovery_costs_the_step_in_flights_time_and_keeps_its_attempt() -> None:
    config = replace(SMALL, live_recover_s=40.0)
    events = [Interruption(3600.0, "software bug", Effect.RANK_DIES, 3)]
    on, off = simulate(config, Mechanisms(), events), simulate(config, Mechanisms(live_recovery=False), events)
    assert violations(on, 1.0) == [] and violations(off, 1.0) == []
    assert len(on.state.attempts) == 1 and len(off.state.attempts) == 2
    [rec] = on.state.live_recoveries
    assert rec.path == "live" and rec.ranks == [24] and rec.steps_lost == 0 and rec.generation == 1
    assert rec.seconds == pytest.approx(40.0 + config.checkpoint_gb_per_rank / config.network_gb_s)
    assert on.budgets == off.budgets == {"worker": 1}
    # The recovery (the step in flight, kept but waiting for the replacement's part, and the replacement's 40 s) is
    # held as a live recovery, nothing else: the run is behind a run that never failed by at most that and one step.
    gap = on.goodput.live_recoveries_s
    assert on.goodput.restarts_s == 0 and off.goodput.live_recoveries_s == 0
    assert 40.0 < gap < 40.0 + 2 * config.step_s and gap < off.goodput.restarts_s
    assert on.reports[1][-1].index + 1 >= (86_400 - config.startup_s - gap) // (config.step_s + 0.016) - 1


def test_a_lost_nodes_ranks_go_on_live_on_a_free_spare_shrink_live_when_none_is_free_and_restart_if_not_elastic(
) -> None:
    events = [Interruption(3600.0, "faulty GPU", Effect.NODE_LOST, 3)]
    r = simulate(SMALL, Mechanisms(), events)
    [rec] = r.state.live_recoveries
    assert rec.path == "live" and len(r.state.attempts) == 1 and r.budgets == {"worker": 1}  # the node: one failure
    assert rec.ranks == list(range(3 * SMALL.ranks_per_node, 4 * SMALL.ranks_per_node))
    assert violations(r, 1.0) == []
    # No spare: the elastic run goes on a node smaller in the same attempt (its step in flight lost), and grows back
    # live once the scheduler's node comes (`replace_s` later), as the controller's `LiveRun` decides.
    r = simulate(SMALL, Mechanisms(spares=False), events)
    shrink, grow = r.state.live_recoveries
    assert (shrink.path, shrink.steps_lost, grow.path, grow.steps_lost) == ("live", 1, "live", 0)
    assert shrink.cause.startswith("shrink") and grow.cause.startswith("grow") and len(r.state.attempts) == 1
    assert [(x.from_workers, x.to_workers) for x in r.state.resizes] == [
        (SMALL.nodes * SMALL.ranks_per_node, (SMALL.nodes - 1) * SMALL.ranks_per_node),
        ((SMALL.nodes - 1) * SMALL.ranks_per_node, SMALL.nodes * SMALL.ranks_per_node)]
    assert grow.time == pytest.approx(WALL0 + 3600.0 + SMALL.timeouts.node_lost_after_s + SMALL.replace_s)
    assert r.node_seconds_short / 3600 == pytest.approx((SMALL.timeouts.node_lost_after_s + SMALL.replace_s) / 3600,
                                                        abs=0.1)
    assert violations(r, 1.0) == []
    r = simulate(SMALL, Mechanisms(spares=False, elastic=False), events)
    [rec] = r.state.live_recoveries
    assert rec.path == "restart" and "no room" in rec.reason and len(r.state.attempts) == 2
    assert violations(r, 1.0) == []


def test_a_broken_history_is_found() -> None:
    config = FleetConfig(nodes=8, days=1.0)
    r = simulate(config, Mechanisms(), by_mttf(8, 1.0, 12.0, 2.0, random.Random(3)))
    assert violations(r, 1.0) == []
    r.budgets["worker"] = r.budgets.get("worker", 0) + 1
    r.state.attempts[1].restored_from = None
    found = violations(r, 1.0)
    assert any("budgets charged" in v for v in found) and any("restored None" in v for v in found)


def test_the_command_prints_json_and_refuses_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "--nodes", "4", "--days", "0.5", "--mttf-hours", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["controller"]["ranks"] == 32 and out["controller"]["restart_decision_cpu_s"] > 0
    with pytest.raises(SystemExit):
        main(["fleet", "--nodes", "0"])
    assert "--nodes" in capsys.readouterr().err
