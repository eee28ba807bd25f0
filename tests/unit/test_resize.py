"""The elastic run's pure decisions: how many workers fit, when to grow, never onto a draining node."""

from __future__ import annotations

import pytest

from outlast.controller.placement import NodeView, NoCapacity
from outlast.controller.resize import Elastic, Resizes, grow_notice, place_range
from outlast.train.config import ScalingConfig, worker_range


def nodes(*cpus, draining=()):
    return [NodeView(f"n{i}", f"h{i}", {"CPU": c}, draining=f"n{i}" in draining) for i, c in enumerate(cpus)]


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD", "STRICT_SPREAD"])
def test_the_largest_size_that_fits_is_taken_between_min_and_max(strategy):
    placed = place_range(nodes(1, 2, 0), 1, 8, {"CPU": 1}, strategy)
    assert not isinstance(placed, NoCapacity)
    assert len(placed.workers) == (2 if strategy == "STRICT_SPREAD" else 3)
    assert {spec.world_size for _, spec in placed.workers} == {len(placed.workers)}


def test_below_min_nothing_is_placed_and_the_reason_names_the_minimum():
    placed = place_range(nodes(1, 1), 3, 4, {"CPU": 1}, "PACK")
    assert isinstance(placed, NoCapacity) and "minimum of 3" in placed.reason


def test_a_thousand_nodes_are_sized_in_a_few_placements():
    placed = place_range(nodes(*[1] * 1000), 1, 4096, {"CPU": 1}, "PACK")
    assert len(placed.workers) == 1000


def test_growth_counts_no_draining_node_and_waits_out_the_interval():
    r = Resizes(Elastic(2, 4, min_interval_s=60.0), since=100.0)
    assert r.consider_grow(nodes(2, 2, draining={"n1"}), 2, {"CPU": 1}, "PACK", 1000.0).to_workers is None
    early = r.consider_grow(nodes(2, 2), 2, {"CPU": 1}, "PACK", 130.0)
    assert early.to_workers is None and "elastic_resize_monitor_interval_s" in early.reason
    assert r.consider_grow(nodes(2, 2), 2, {"CPU": 1}, "PACK", 160.0).to_workers == 4
    assert r.consider_grow(nodes(2, 2), 4, {"CPU": 1}, "PACK", 160.0).to_workers is None
    assert Resizes(None).consider_grow(nodes(8), 1, {"CPU": 1}, "PACK", 0.0).to_workers is None


def test_a_grow_notice_preempts_no_rank_and_restarts_only_once_saved():
    r = Resizes(Elastic(1, 4, 0.0))
    grow = r.consider_grow(nodes(4), 2, {"CPU": 1}, "PACK", 5.0)
    p = grow_notice(grow, 2, [3, 3], 5.0, 1e9)
    msg = p.notice_message(7, 9)
    assert msg.reason == "resize" and msg.ranks == [] and msg.deadline_unix_ms is None
    assert not p.decide(1e9, None, True).restart_now  # no deadline: a step is never thrown away
    assert p.decide(6.0, "checkpoint_000003", False).restart_now


@pytest.mark.parametrize("bad", [(3, 2), (0, 2), (1, 2, 3), ("1", 2), (1.5, 2)])
def test_a_bad_worker_range_says_what_is_wrong(bad):
    with pytest.raises(ValueError, match="num_workers"):
        ScalingConfig(num_workers=bad)


def test_a_range_and_a_fixed_size_read_the_same_way():
    assert worker_range(ScalingConfig(num_workers=(2, 4))) == (2, 4)
    assert worker_range(ScalingConfig(num_workers=[2, 4])) == (2, 4)
    assert worker_range(ScalingConfig(num_workers=3)) == (3, 3)
    with pytest.raises(ValueError, match="elastic_resize_monitor_interval_s"):
        ScalingConfig(num_workers=(1, 2), elastic_resize_monitor_interval_s=-1)
