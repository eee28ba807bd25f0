import pytest

from outlast.controller.commit import CommitTracker
from outlast.protocol.messages import FileEntry


def files(*names):
    return [FileEntry(path=n, size=1, sha256="0" * 64) for n in names]


def test_checkpoint_from_rank_zero_only_is_whole_after_every_rank_made_that_report():
    t = CommitTracker(world_size=3)
    assert t.on_report(0, 0, "ckpt_a", files("model.pt"), {"loss": 1.0}) == []
    assert t.on_report(1, 0, None, [], {"loss": 9.0}) == []
    [done] = t.on_report(2, 0, None, [], {})
    assert (done.index, done.checkpoint_dir) == (0, "ckpt_a")
    assert done.files == {0: files("model.pt")}
    assert done.metrics == {"loss": 1.0}


def test_sharded_checkpoint_collects_the_files_of_every_rank():
    t = CommitTracker(world_size=2)
    t.on_report(0, 0, "c", files("shard0"), {})
    [done] = t.on_report(1, 0, "c", files("shard1"), {})
    assert done.files == {0: files("shard0"), 1: files("shard1")}


def test_rank_zero_metrics_win_even_when_another_rank_reported_first():
    t = CommitTracker(world_size=2)
    t.on_report(1, 0, "c", files("b"), {"who": 1})
    [done] = t.on_report(0, 0, "c", files("a"), {"who": 0})
    assert done.metrics == {"who": 0}


def test_out_of_order_arrival_completes_only_when_the_slowest_rank_catches_up():
    t = CommitTracker(world_size=2)
    assert t.on_report(1, 0, "c0", files("x"), {}) == []
    assert t.on_report(1, 1, "c1", files("y"), {}) == []
    assert t.waiting_for(0) == [0]
    [done] = t.on_report(0, 0, "c0", files("z"), {})
    assert done.index == 0
    assert t.waiting_for(1) == [0]


def test_pending_checkpoints_held_back_by_a_slow_rank_are_released_oldest_first():
    # min(reports) rises by at most one per report, so each report releases at most one.
    t = CommitTracker(world_size=2)
    for i in range(3):
        assert t.on_report(0, i, f"c{i}", files("m"), {"step": i}) == []
    released = [t.on_report(1, i, None, [], {}) for i in range(3)]
    assert [[p.checkpoint_dir for p in batch] for batch in released] == [["c0"], ["c1"], ["c2"]]
    assert [batch[0].metrics for batch in released] == [{"step": 0}, {"step": 1}, {"step": 2}]


def test_a_report_without_a_checkpoint_between_two_checkpoints_is_skipped():
    t = CommitTracker(world_size=2)
    t.on_report(0, 0, "c0", files("m"), {})
    t.on_report(0, 1, None, [], {})
    t.on_report(0, 2, "c2", files("m"), {})
    released = [p.index for i in range(3) for p in t.on_report(1, i, None, [], {})]
    assert released == [0, 2]


def test_a_report_without_any_checkpoint_returns_nothing():
    t = CommitTracker(world_size=1)
    assert t.on_report(0, 0, None, [], {"loss": 1}) == []


def test_a_checkpoint_is_returned_only_once():
    t = CommitTracker(world_size=1)
    assert len(t.on_report(0, 0, "c0", files("m"), {})) == 1
    assert t.on_report(0, 1, None, [], {}) == []


@pytest.mark.parametrize("index", [1, -1])
def test_an_index_out_of_sequence_raises_and_changes_nothing(index):
    t = CommitTracker(world_size=2)
    with pytest.raises(ValueError, match=f"rank 1 sent report {index}, expected 0"):
        t.on_report(1, index, "c", files("m"), {})
    assert t.reports == [0, 0]


def test_a_repeated_index_raises():
    t = CommitTracker(world_size=2)
    t.on_report(0, 0, None, [], {})
    with pytest.raises(ValueError, match="expected 1"):
        t.on_report(0, 0, None, [], {})


def test_a_checkpoint_carries_rank_zeros_metrics_even_when_rank_zero_had_no_files():
    tracker = CommitTracker(world_size=2)
    assert tracker.on_report(0, 0, None, [], {"loss": 0.1, "from": 0}) == []
    ready = tracker.on_report(1, 0, "checkpoint_001_000000", [FileEntry("shard1", 1, "x")], {"from": 1})
    assert [p.metrics for p in ready] == [{"loss": 0.1, "from": 0}]


def test_a_report_from_a_rank_outside_the_world_is_refused():
    tracker = CommitTracker(world_size=2)
    with pytest.raises(ValueError, match="outside the world"):
        tracker.on_report(2, 0, None, [], {})
    with pytest.raises(ValueError, match="outside the world"):
        tracker.on_report(-1, 0, None, [], {})
