import pytest

from outlast.controller.collectives import CollectiveTracker


def tracker(world_size=3, warn=10.0, timeout=60.0):
    return CollectiveTracker(world_size, warn_after_s=warn, timeout_s=timeout)


def test_a_collective_completes_only_when_every_rank_arrived():
    t = tracker()
    assert t.arrive(0, 0, "barrier", None, now=0.0) is None
    assert t.arrive(2, 0, "barrier", None, now=1.0) is None
    done = t.arrive(1, 0, "barrier", None, now=2.0)
    assert done is not None
    assert (done.seq, done.op, done.arrived) == (0, "barrier", {0, 1, 2})


def test_a_rank_arriving_twice_counts_once():
    t = tracker(world_size=2)
    t.arrive(1, 0, "barrier", None, 0.0)
    assert t.arrive(1, 0, "barrier", None, 0.0) is None


def test_broadcast_carries_the_payload_of_rank_zero_whoever_arrives_last():
    t = tracker(world_size=2)
    t.arrive(0, 5, "broadcast", b"from-zero", 0.0)
    done = t.arrive(1, 5, "broadcast", b"ignored", 0.0)
    assert done.payload == b"from-zero"


def test_separate_sequence_numbers_are_tracked_independently():
    t = tracker(world_size=2)
    t.arrive(0, 0, "barrier", None, 0.0)
    t.arrive(0, 1, "broadcast", b"x", 0.0)
    assert t.arrive(1, 1, "broadcast", None, 0.0).seq == 1
    assert t.arrive(1, 0, "barrier", None, 0.0).seq == 0


def test_mismatched_ops_on_one_sequence_number_raise_naming_both():
    t = tracker()
    t.arrive(0, 3, "barrier", None, 0.0)
    with pytest.raises(ValueError, match=r"collective #3: rank 1 called broadcast while other ranks called barrier"):
        t.arrive(1, 3, "broadcast", b"", 0.0)


def test_nothing_is_overdue_before_the_warning_interval():
    t = tracker()
    t.arrive(0, 0, "barrier", None, now=100.0)
    assert t.overdue(now=109.9) == []


def test_a_slow_collective_warns_once_per_interval_naming_who_is_missing():
    t = tracker(warn=10.0, timeout=60.0)
    t.arrive(0, 0, "barrier", None, now=0.0)
    t.arrive(2, 0, "barrier", None, now=1.0)
    [w] = t.overdue(now=10.0)
    assert (w.timed_out, w.missing, w.arrived, w.waited_s) == (False, [1], [0, 2], 10.0)
    assert t.overdue(now=15.0) == []
    assert t.overdue(now=19.9) == []
    assert [o.waited_s for o in t.overdue(now=20.0)] == [20.0]


def test_a_collective_times_out_naming_the_missing_ranks_and_is_dropped():
    t = tracker(world_size=4, warn=10.0, timeout=60.0)
    t.arrive(1, 7, "broadcast", None, now=0.0)
    [o] = t.overdue(now=60.0)
    assert (o.seq, o.op, o.timed_out, o.missing, o.arrived) == (7, "broadcast", True, [0, 2, 3], [1])
    assert t.overdue(now=120.0) == []


def test_a_completed_collective_is_never_overdue():
    t = tracker(world_size=1)
    assert t.arrive(0, 0, "barrier", None, now=0.0) is not None
    assert t.overdue(now=1000.0) == []


# ---- lost ranks (relax_collectives_on_preemption) ----------------------------------------


def test_a_barrier_completes_when_the_ranks_it_waits_for_are_lost():
    t = tracker(world_size=3)
    t.arrive(0, 0, "barrier", None, 0.0)
    t.arrive(2, 0, "barrier", None, 0.0)
    t.arrive(0, 1, "barrier", None, 0.0)
    [done] = t.lose_ranks({1})
    assert (done.seq, done.arrived) == (0, {0, 2})
    assert t.arrive(2, 1, "barrier", None, 0.0).seq == 1  # afterwards only survivors are waited for


def test_a_loss_completes_several_collectives_in_sequence_order():
    t = tracker(world_size=2)
    t.arrive(0, 4, "barrier", None, 0.0)
    t.arrive(0, 3, "barrier", None, 0.0)
    assert [p.seq for p in t.lose_ranks({1})] == [3, 4]


def test_a_broadcast_whose_rank_zero_is_lost_carries_the_lowest_surviving_ranks_payload():
    t = tracker(world_size=4)
    t.arrive(3, 0, "broadcast", b"three", 0.0)
    t.arrive(2, 0, "broadcast", b"two", 0.0)
    assert t.lose_ranks({0}) == []
    done = t.arrive(1, 0, "broadcast", b"one", 0.0)
    assert done.payload == b"one"


def test_a_broadcast_skips_a_lost_ranks_payload_when_rank_zero_is_lost_too():
    t = tracker(world_size=3)
    t.arrive(1, 0, "broadcast", b"one", 0.0)
    t.arrive(2, 0, "broadcast", b"two", 0.0)
    [done] = t.lose_ranks({0, 1})
    assert done.payload == b"two"


def test_rank_zeros_payload_wins_while_it_lives_and_once_it_arrived():
    t = tracker(world_size=3)
    t.arrive(1, 0, "broadcast", b"one", 0.0)
    t.arrive(0, 0, "broadcast", b"zero", 0.0)
    assert t.arrive(2, 0, "broadcast", b"two", 0.0).payload == b"zero"
    t.arrive(0, 1, "broadcast", b"zero", 0.0)
    t.arrive(1, 1, "broadcast", b"one", 0.0)
    [done] = t.lose_ranks({0, 2})  # rank 0 spoke before its node went
    assert done.payload == b"zero"


def test_an_arrival_from_a_lost_rank_is_ignored():
    t = tracker(world_size=2)
    t.lose_ranks({1})
    assert t.arrive(1, 0, "broadcast", b"late", 0.0) is None
    assert t.arrive(1, 0, "barrier", None, 0.0) is None  # not even checked against the op
    done = t.arrive(0, 0, "barrier", None, 0.0)
    assert done.arrived == {0}


def test_overdue_does_not_list_lost_ranks_as_missing():
    t = tracker(world_size=4, warn=10.0, timeout=60.0)
    t.arrive(0, 0, "barrier", None, now=0.0)
    t.lose_ranks({3})
    [w] = t.overdue(now=10.0)
    assert w.missing == [1, 2]


def test_allgather_carries_every_ranks_payload_by_rank_whatever_the_order_of_arrival():
    from outlast.protocol.messages import read_gathered

    t = tracker(world_size=3)
    assert t.arrive(2, 0, "allgather", b"two", 0.0) is None
    assert t.arrive(0, 0, "allgather", b"zero", 0.0) is None
    done = t.arrive(1, 0, "allgather", b"one", 0.0)
    assert read_gathered(done.payload) == {0: b"zero", 1: b"one", 2: b"two"}


def test_allgather_completed_by_a_loss_leaves_the_lost_rank_out_even_if_it_arrived_first():
    from outlast.protocol.messages import read_gathered

    t = tracker(world_size=3)
    t.arrive(1, 0, "allgather", b"one", 0.0)
    t.arrive(0, 0, "allgather", b"zero", 0.0)
    [done] = t.lose_ranks({1, 2})
    assert read_gathered(done.payload) == {0: b"zero"}
