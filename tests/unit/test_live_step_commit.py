"""The pure core of live recovery: step verdicts, the ledger, memberships."""

from __future__ import annotations

import pytest

from outlast.protocol.membership import Membership, MembershipError, first_membership, replace_members
from outlast.train.live.step_commit import Ledger, StepVerdict, agreed_step, tally, while_waiting


def test_a_rank_whose_allreduce_raised_votes_the_step_away_whatever_the_count():
    t = tally(reduced=False, votes_counted=1, world_size=2)
    assert t.verdict is StepVerdict.ABORT and "raised" in t.reason


def test_the_last_reduced_vote_commits_and_an_earlier_one_waits():
    assert tally(True, 3, 3).verdict is StepVerdict.COMMIT
    waiting = tally(True, 2, 3)
    assert waiting.verdict is None and "2 of 3" in waiting.reason


def test_a_newer_generation_voids_an_open_vote_and_nothing_else_does():
    assert while_waiting(newer_generation=True).verdict is StepVerdict.ABORT
    assert while_waiting(newer_generation=False).verdict is None


def test_the_ledger_moves_committed_only_on_commit():
    ledger = Ledger(generation=0).begin(0)
    assert ledger.in_flight == 0
    ledger = ledger.after(StepVerdict.COMMIT).begin(1).after(StepVerdict.ABORT)
    assert (ledger.committed, ledger.in_flight) == (0, None)
    assert ledger.regroup(1, 0) == Ledger(1, 0, None)


def test_the_ledger_refuses_a_step_out_of_order_or_two_at_once():
    with pytest.raises(RuntimeError, match="still in flight"):
        Ledger(0).begin(0).begin(1)
    with pytest.raises(RuntimeError, match="one at a time"):
        Ledger(0).begin(2)
    with pytest.raises(RuntimeError, match="no step in flight"):
        Ledger(0).after(StepVerdict.COMMIT)


def test_survivors_agree_on_their_committed_step_and_joiners_are_not_asked():
    assert agreed_step({0: 7, 1: -1, 2: 7}, joiners=(1,)) == 7


def test_survivors_that_disagree_stop_the_group_with_the_steps_they_hold():
    with pytest.raises(RuntimeError, match=r"different committed steps \{0: 7, 2: 6\}"):
        agreed_step({0: 7, 1: -1, 2: 6}, joiners=(1,))


def test_a_replacement_takes_the_lost_rank_and_the_lowest_kept_rank_sends():
    m0 = first_membership(["a", "b", "c"])
    m1 = replace_members(m0, {"a": "s"})
    assert m1 == Membership(1, ("s", "b", "c"), joiners=(0,), source=1)
    assert m1.rank_of("s") == 0 and m1.rank_of("a") is None
    assert Membership.from_json(m1.to_json()) == m1


def test_losing_every_member_has_no_source_and_says_to_restart_from_a_checkpoint():
    with pytest.raises(MembershipError, match="newest checkpoint"):
        replace_members(first_membership(["a", "b"]), {"a": "x", "b": "y"})


def test_bad_memberships_say_what_is_wrong():
    with pytest.raises(MembershipError, match="cannot replace"):
        replace_members(first_membership(["a"]), {"z": "s"})
    with pytest.raises(MembershipError, match="twice"):
        Membership(0, ("a", "a"))
    with pytest.raises(MembershipError, match="must send it"):
        Membership(1, ("a", "b"), joiners=(0,), source=None)


@pytest.mark.torch
def test_a_state_that_does_not_match_its_senders_checksum_is_refused():
    import torch

    from outlast.train.live.state_transfer import StateTransferCorrupt, digest, join, split

    state = {"w": torch.arange(4.0), "opt": {"step": 3, "groups": [{"lr": 0.1}]}, "b": torch.ones(2, 2).t()}
    header, tensors = split(state)
    back = join(header, tensors, digest(header, tensors))
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"]) and back["opt"] == state["opt"]
    expected = digest(header, tensors)
    tensors[0][-1] = 5.0
    with pytest.raises(StateTransferCorrupt, match="xxh3_128"):
        join(header, tensors, expected)


def test_ranks_that_restored_a_checkpoint_offer_its_step_to_their_first_group():
    from outlast.sim.live import MemStore
    from outlast.train.live.live_rank import LiveRank

    fresh, restored = LiveRank(MemStore(), "r0i0"), LiveRank(MemStore(), "r1i0")
    restored.resume_at(5)
    first = first_membership(["r0i0", "r1i0"])
    assert fresh.offered(first) == -1 and restored.offered(first) == 4
    assert restored.entered(first, 1, agreed_step({0: 4, 1: 4}, ()), 0, 0.0) == 5
    with pytest.raises(RuntimeError, match="only a loop that just restored"):
        restored.resume_at(2)


def test_a_split_vote_is_the_same_vote_the_one_that_waits_gives():
    from outlast.sim.live import MemStore
    from outlast.train.live.commit_store import StepVotes

    store = MemStore()
    first, second = StepVotes(store, 0, 2), StepVotes(store, 0, 2)
    assert first.cast(0, reduced=True)[0] is None and first.poll(0)[0] is None
    assert second.vote(0, reduced=True)[0] is StepVerdict.COMMIT
    assert first.poll(0)[0] is StepVerdict.COMMIT
    # A newer generation published while a vote is open throws the step away; the first verdict written stands.
    store.set("live/membership/1", Membership(1, ("w0.1", "w1.0"), (0,), 1).to_json())
    assert first.cast(1, reduced=True)[0] is StepVerdict.ABORT and second.cast(1, reduced=True)[0] is StepVerdict.ABORT


def test_a_step_that_broke_and_was_kept_is_announced_as_no_step_lost_and_one_thrown_away_as_one():
    import json

    from outlast.protocol.membership import joined_key
    from outlast.sim.live import MemStore
    from outlast.train.live.live_rank import LiveRank

    def after_a_broken_step(keep: bool) -> int:
        store = MemStore()
        rank = LiveRank(store, "r0i0")
        first = first_membership(["r0i0", "r1i0"])
        rank.entered(first, 0, agreed_step({0: -1, 1: -1}, ()), 0, 0.0)
        rank.begin(0)
        assert rank.settle(StepVerdict.ABORT) is False
        if keep:
            rank.keep_in_flight()
        second = replace_members(first, {"r1i0": "r1i1"})
        assert rank.announce(second, 0)
        return json.loads(store.get(joined_key(second.generation)))["steps_lost"]

    assert after_a_broken_step(keep=True) == 0
    assert after_a_broken_step(keep=False) == 1
    rank = LiveRank(MemStore(), "r0i0")
    with pytest.raises(RuntimeError, match="no step broken"):
        rank.keep_in_flight()
