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


# ---- lost ranks (relax_collectives_on_preemption) ----------------------------------------


def test_a_replicated_checkpoint_commits_with_the_survivors_when_a_rank_is_lost_before_reporting():
    t = CommitTracker(world_size=3)
    t.on_report(0, 0, "c0", files("model.pt"), {"loss": 1.0})
    t.on_report(2, 0, None, [], {})
    outcome = t.lose_ranks({1})
    [done] = outcome.settled
    assert outcome.whole == [done] and outcome.incomplete == []
    assert (done.checkpoint_dir, done.files, done.metrics, done.missing_shards) == \
        ("c0", {0: files("model.pt")}, {"loss": 1.0}, [])


def test_a_sharded_checkpoint_missing_a_lost_holders_shard_is_never_whole_and_says_whose():
    t = CommitTracker(world_size=3)
    t.on_report(0, 0, "c0", files("shard0"), {})
    t.on_report(2, 0, "c0", files("shard2"), {})
    [failed] = t.lose_ranks({1}).incomplete
    assert failed.missing_shards == [1]
    assert 1 in failed.errors  # a commit path that refuses errors refuses this one too
    assert failed.waiting == {0, 2}  # they are blocked in report() and must be told
    assert failed.missing_reason() == "checkpoint c0 is missing the shards of ranks [1] (lost before delivering them)"
    assert failed.missing_reason({1: "n2"}) == "checkpoint c0 is missing the shards of ranks [1] (lost with node n2)"


def test_losing_a_rank_that_already_delivered_its_shard_costs_nothing():
    t = CommitTracker(world_size=3)
    t.on_report(0, 0, "c0", files("shard0"), {})
    t.on_report(1, 0, "c0", files("shard1"), {})
    assert t.lose_ranks({1}).settled == []  # rank 2 has not reported yet
    [done] = t.on_report(2, 0, "c0", files("shard2"), {})
    assert done.missing_shards == [] and sorted(done.files) == [0, 1, 2]


def test_the_decision_waits_for_the_survivors_then_uses_what_they_contributed():
    t = CommitTracker(world_size=3)
    t.on_report(0, 0, "c0", files("shard0"), {})
    assert t.lose_ranks({1}).settled == []
    assert t.waiting_for(0) == [2]
    [failed] = t.on_report(2, 0, "c0", files("shard2"), {})  # now two contributors: sharded
    assert failed.missing_shards == [1]


def test_losing_rank_zero_of_a_sharded_checkpoint_fails_it_and_later_metrics_come_from_the_new_lead():
    t = CommitTracker(world_size=3)
    for r in range(3):
        t.on_report(r, 0, "c0", files(f"s{r}"), {"from": r})
    t.on_report(1, 1, "c1", files("s1"), {"from": 1})
    t.on_report(2, 1, "c1", files("s2"), {"from": 2})
    [failed] = t.lose_ranks({0}).settled
    assert (failed.checkpoint_dir, failed.missing_shards) == ("c1", [0])
    assert failed.waiting == {1, 2}
    t.on_report(2, 2, None, [], {"from": 2})
    [done] = t.on_report(1, 2, "c2-replicated", files("m"), {"from": 1})
    assert done.metrics == {"from": 1}
    assert done.missing_shards == [0]  # history: rank 0 held a shard of c0, so of c2 too


def test_a_lost_rank_whose_asynchronous_upload_was_running_misses_its_shard():
    t = CommitTracker(world_size=2)
    t.on_report(0, 0, "c0", files("shard0"), {})
    t.on_report(1, 0, "c0", [], {}, upload_pending=True)
    [failed] = t.lose_ranks({1}).settled
    assert failed.missing_shards == [1]
    assert t.on_upload_done(1, 0, "c0", files("shard1"), None) == []  # too late


def test_an_upload_that_finished_before_the_lost_ranks_report_arrived_still_counts():
    t = CommitTracker(world_size=2)
    t.on_report(0, 0, "c0", files("shard0"), {})
    assert t.on_upload_done(1, 0, "c0", files("shard1"), None) == []  # its Report never arrives
    [done] = t.lose_ranks({1}).settled
    assert done.missing_shards == [] and done.files == {0: files("shard0"), 1: files("shard1")}


def test_a_loss_settles_an_earlier_checkpoint_and_then_a_later_one():
    t = CommitTracker(world_size=2)
    t.on_report(0, 0, "c0", files("m"), {"step": 0})
    t.on_report(0, 1, "c1", files("m"), {"step": 1})
    outcome = t.lose_ranks({1})
    assert [(p.checkpoint_dir, p.metrics, p.missing_shards) for p in outcome.settled] == \
        [("c0", {"step": 0}, []), ("c1", {"step": 1}, [])]
    [done] = t.on_report(0, 2, "c2", files("m"), {})  # from now on rank 0 alone is waited for
    assert done.index == 2


def test_a_checkpoint_missing_a_shard_does_not_hold_back_the_next_one():
    t = CommitTracker(world_size=2, shard_holders={0, 1})
    t.on_report(0, 0, "c0", files("s0"), {})
    t.on_report(0, 1, "c1", files("s0"), {})
    [c0, c1] = t.lose_ranks({1}).settled
    assert (c0.missing_shards, c1.missing_shards) == ([1], [1])


def test_a_report_from_a_lost_rank_is_a_straggler_and_is_ignored():
    t = CommitTracker(world_size=2)
    t.lose_ranks({1})
    assert t.on_report(1, 5, "c5", files("x"), {}) == []  # out of sequence too, yet no error
    assert t.reports == [0, 0]
    [done] = t.on_report(0, 0, "c0", files("m"), {})
    assert done.files == {0: files("m")}


def test_waiting_for_leaves_lost_ranks_out():
    t = CommitTracker(world_size=3)
    t.lose_ranks({1})
    assert t.waiting_for(0) == [0, 2]


def test_history_seeded_from_the_restored_manifest_decides_for_ranks_that_never_reported():
    replicated = CommitTracker(world_size=2, shard_holders={0})
    replicated.on_report(0, 0, "c0", files("m"), {})
    assert replicated.lose_ranks({1}).settled[0].missing_shards == []
    sharded = CommitTracker(world_size=2, shard_holders={0, 1})
    sharded.on_report(0, 0, "c0", files("m"), {})
    assert sharded.lose_ranks({1}).settled[0].missing_shards == [1]


def test_history_of_a_whole_checkpoint_replaces_the_seed():
    t = CommitTracker(world_size=3, shard_holders={0, 1, 2})
    t.on_report(0, 0, "c0", files("m"), {})
    t.on_report(1, 0, None, [], {})
    [done] = t.on_report(2, 0, None, [], {})  # this run saves from rank 0 alone
    assert done.missing_shards == []
    t.on_report(0, 1, "c1", files("m"), {})
    t.on_report(1, 1, None, [], {})
    [done] = t.lose_ranks({2}).settled
    assert done.missing_shards == []


def test_losing_ranks_outside_the_world_is_refused_and_losing_twice_is_harmless():
    t = CommitTracker(world_size=2)
    with pytest.raises(ValueError, match="outside the world"):
        t.lose_ranks({2})
    assert t.lost == set()
    t.lose_ranks({1})
    assert t.lose_ranks({1}).settled == []


def test_missing_reason_names_every_node_the_ranks_were_lost_with():
    t = CommitTracker(world_size=4, shard_holders={0, 1, 2, 3})
    t.on_report(0, 0, "c0", files("s0"), {})
    t.on_report(1, 0, "c0", files("s1"), {})
    [failed] = t.lose_ranks({2, 3}).settled
    assert failed.missing_reason({2: "n2", 3: "n3"}) == \
        "checkpoint c0 is missing the shards of ranks [2, 3] (lost with nodes n2, n3)"


def test_a_checkpoint_keeps_every_ranks_data_position_even_from_ranks_without_files():
    t = CommitTracker(world_size=2)
    t.on_report(1, 0, None, [], {}, data_position="one@0")
    [done] = t.on_report(0, 0, "c", files("m"), {}, data_position="zero@0")
    assert done.data_positions == {0: "zero@0", 1: "one@0"}


def test_a_rank_lost_before_its_report_is_placed_where_its_last_report_left_it():
    t = CommitTracker(world_size=2)
    t.on_report(0, 0, None, [], {}, data_position="zero@0")
    t.on_report(1, 0, None, [], {}, data_position="one@0")
    t.on_report(0, 1, "c", files("m"), {}, data_position="zero@1")
    [done] = t.lose_ranks({1}).settled
    assert done.data_positions == {0: "zero@1", 1: "one@0"}


def test_a_rank_a_live_shrink_left_out_has_no_part_in_the_reports_of_the_smaller_world():
    # Ranks 0 and 2 go on as a world of 2 (generation 1) after rank 1's node was lost: a checkpoint of a step before
    # (generation 0) has rank 1's last place and misses its shard, as a lost rank's; one the smaller world reported
    # has neither: what rank 1 had not read was split between ranks 0 and 2, and it holds no shard of their state.
    t = CommitTracker(world_size=3)
    for rank in range(3):
        t.on_report(rank, 0, None, [], {}, data_position=f"{rank}@0")
    t.on_report(0, 1, "c1", files("m"), {}, data_position="0@1")
    t.on_report(2, 1, "c1", files("n"), {}, data_position="2@1")
    [old] = t.lose_ranks({1}, left_from=1).settled
    assert old.data_positions == {0: "0@1", 1: "1@0", 2: "2@1"} and old.missing_shards == [1]
    t.on_report(2, 2, "c2", files("n"), {}, data_position="2@2", generation=1)
    [new] = t.on_report(0, 2, "c2", files("m"), {}, data_position="0@2", generation=1)
    assert new.data_positions == {0: "0@2", 2: "2@2"} and new.missing_shards == []


def test_a_replacement_that_skips_the_report_its_predecessor_never_made_lets_later_checkpoints_settle():
    # Live recovery: rank 0 died after committing step 1 and before reporting it; the others reported it. Its
    # replacement reports from index 2 on, and the checkpoint of report 2 settles once every rank made it.
    t = CommitTracker(world_size=3)
    for rank in range(3):
        t.on_report(rank, 0, None, [], {})
    t.on_report(1, 1, None, [], {})
    t.on_report(2, 1, None, [], {})
    t.skip_to(0, 2)
    assert t.on_report(1, 2, None, [], {}) == []
    assert t.on_report(2, 2, None, [], {}) == []
    [done] = t.on_report(0, 2, "ckpt_2", files("model.pt"), {"step": 2})
    assert (done.index, done.checkpoint_dir) == (2, "ckpt_2")


def test_a_rank_replaced_before_reporting_a_committed_step_holds_up_no_checkpoint_until_its_replacement_reports():
    # Rank 1 died after every rank committed step 1 and before it reported it; rank 0 reported step 1 with a
    # checkpoint (its files alone) and waits for the commit, before it sends the state to rank 1's replacement.
    t = CommitTracker(world_size=2, shard_holders=[0])
    for rank in range(2):
        t.on_report(rank, 0, None, [], {})
    assert t.on_report(0, 1, "ckpt_1", files("model.pt"), {"step": 1}) == []
    [done] = t.replaced(1)
    assert (done.index, done.missing_shards) == (1, [])
    # The replacement reports from the count of rank 0, whose state it took; from there it is waited for again.
    t.skip_to(1, 2)
    assert t.on_report(0, 2, "ckpt_2", files("model.pt"), {"step": 2}) == []
    [done] = t.on_report(1, 2, None, [], {})
    assert done.index == 2


def test_a_replaced_rank_that_held_a_shard_it_never_reported_leaves_that_checkpoint_incomplete():
    t = CommitTracker(world_size=2)
    t.on_report(0, 0, "c0", files("s0"), {})
    t.on_report(1, 0, "c0", files("s1"), {})
    t.on_report(0, 1, "c1", files("s0"), {})
    [done] = t.replaced(1)
    assert done.index == 1 and set(done.missing_shards) == {1}


def test_a_rank_lost_while_uploading_leaves_its_checkpoint_missing_its_shard():
    t = CommitTracker(world_size=2)
    t.on_report(0, 0, "ckpt_0", [], {}, upload_pending=True)
    t.on_report(1, 0, None, [], {})
    assert [p.missing_shards for p in t.lose_uploads(0)] == [[0]]
