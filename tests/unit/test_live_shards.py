"""The optimizer's state split between ranks under live recovery: who sends a joiner its shard, when the controller
falls back because no copy of a shard is left, and the flat shards' arithmetic (`outlast/train/torch/live_shards.py`,
over a stand-in for the group: what it gathers)."""

from __future__ import annotations

import functools

import pytest

from outlast.controller.live import FallBack, LiveRun, Planned, Replace, StayPut
from outlast.protocol.membership import Membership, MembershipError, unheld_shards


def sharded(world_size: int, shards: int) -> LiveRun:
    live = LiveRun(world_size)
    live.on_joined(0, 0, 1.0, shards=shards)  # generation 0's word: the group formed, with its shards
    return live


def test_a_joiner_takes_the_state_from_the_lowest_rank_that_holds_its_shard():
    m = Membership(1, tuple(f"m{r}" for r in range(6)), joiners=(1, 2), source=0)
    assert [m.sender(j, 3) for j in (1, 2)] == [4, 5]  # shards 1 and 2 are held on ranks 4 and 5 too
    assert m.sender(1) == 0 == m.source  # one shard: every joiner takes it from the source
    with pytest.raises(MembershipError, match="every rank holding its shard 1 of 3 joins too"):
        Membership(1, tuple(f"m{r}" for r in range(6)), joiners=(1, 4), source=0).sender(4, 3)


def test_a_shard_is_unheld_only_when_every_holder_is_leaving():
    assert unheld_shards(4, {1}, 2) == []
    assert unheld_shards(4, {1, 3}, 2) == [1]
    assert unheld_shards(4, {0, 1, 3}, 2) == [1]
    assert unheld_shards(4, {0, 1, 2, 3}, 2) == [0, 1]
    assert unheld_shards(2, {1}, 1) == [] and unheld_shards(2, {0, 1}, 1) == [0]


def test_a_lost_rank_is_replaced_from_its_shard_s_other_holder_and_a_second_loss_of_that_shard_falls_back():
    live = sharded(4, 2)
    first = live.on_death(1, "SIGKILL", 2.0)
    assert isinstance(first, Replace) and "rank 3 sends the state to rank(s) [1]" in first.reason
    assert first.membership.sender(1, 2) == 3
    # Rank 3 dies before rank 1's replacement took shard 1 from it: no copy of shard 1 is left.
    second = live.on_death(3, "SIGKILL", 2.1)
    assert isinstance(second, FallBack)
    assert "every rank holding shard(s) [1] of the optimizer's 2" in second.reason


def test_two_deaths_of_different_shards_are_one_recovery_with_a_sender_each():
    live = sharded(4, 2)
    assert isinstance(live.on_death(1, "SIGKILL", 2.0), Replace)
    both = live.on_death(2, "SIGKILL", 2.1)
    assert isinstance(both, Replace) and both.membership.joiners == (1, 2)
    assert {j: both.membership.sender(j, 2) for j in both.membership.joiners} == {1: 3, 2: 0}
    assert "ranks 0 (to [2]), 3 (to [1]) send" in both.reason


def test_one_replica_alone_falls_back_at_any_death_and_says_why():
    decision = sharded(2, 2).on_death(0, "SIGKILL", 2.0)
    assert isinstance(decision, FallBack) and "shard(s) [0]" in decision.reason


def test_a_lost_node_holding_both_copies_of_a_shard_falls_back_at_its_first_rank():
    live = sharded(4, 2)
    assert "shard(s) [1]" in live.unheld([1, 3])
    assert live.unheld([0, 1]) == ""  # ranks 2 and 3 hold both shards


def test_a_sharded_run_does_not_shrink_and_grows_by_whole_replicas():
    live = sharded(4, 2)
    shrink = live.on_shrink([3], "lost", 2.0, least=1, node="n1")
    assert isinstance(shrink, FallBack) and "2 shards" in shrink.reason
    odd = live.on_grow(5, "room", 3.0)
    assert isinstance(odd, StayPut) and odd.later and "not a whole number of replicas" in odd.reason
    grow = live.on_grow(6, "room", 3.0)
    assert isinstance(grow, Planned) and grow.ranks == (4, 5)
    assert [grow.membership.sender(j, 2) for j in grow.membership.joiners] == [0, 1]


def test_a_drain_of_every_holder_of_a_shard_stays_put():
    live = sharded(4, 2)
    decision = live.on_drain([1, 3], "drain", 2.0, None)
    assert isinstance(decision, StayPut) and "shard(s) [1]" in decision.reason
    assert isinstance(live.on_drain([1], "drain", 2.0, None), Planned)


# ---- the flat shards, four ranks in one process -------------------------------------------------------------


class Gathered:
    """A replica's allgather as its rank `rank` sees it: each of its ranks' own piece, once each applied the step."""

    def __init__(self, rank: int, pieces: list) -> None:
        self.rank, self.pieces = rank, pieces

    def allgather(self, tensor):
        return [p.clone() for p in self.pieces]


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))  # 22 parameters


def _step(shards: list, gradient) -> None:
    for s in shards:
        s.apply(gradient[s.shard * s.size:(s.shard + 1) * s.size].clone())
    pieces = [s._piece(s.shard).clone() for s in shards]
    for rank, s in enumerate(shards):
        first = rank - rank % s.shards  # the replica's: its allgather is within the replica
        s.gather(Gathered(rank % s.shards, pieces[first:first + s.shards]))


@pytest.mark.parametrize("world,shards,size", [(4, 2, 11), (6, 3, 8)], ids=["even", "padded"])
def test_split_shards_step_as_one_optimizer_over_every_parameter(world, shards, size):
    import torch

    from outlast.train.torch.live_shards import FlatShards

    adam = functools.partial(torch.optim.Adam, lr=0.1)
    whole = FlatShards(_model(), adam, rank=0, world_size=1, shards=1)
    models = [_model() for _ in range(world)]
    split = [FlatShards(m, adam, rank=r, world_size=world, shards=shards) for r, m in enumerate(models)]
    assert split[0].size == size and split[-1].shard == shards - 1
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        gradient = torch.randn(whole.flat.numel(), generator=g)
        _step([whole], gradient)
        _step(split, torch.cat([gradient, torch.zeros(split[0].flat.numel() - gradient.numel())]))
    for s in split:
        assert torch.equal(s.flat[:s.total], whole.flat[:whole.total])
    # The model's parameters are the flat tensor's views: they moved with it.
    assert torch.equal(torch.cat([p.reshape(-1) for p in models[2].parameters()]), whole.flat[:whole.total])
    # Each rank's optimizer holds its shard's moments alone.
    assert split[1].optimizer.state_dict()["state"][0]["exp_avg"].numel() == size


def test_a_shard_s_state_loads_only_into_a_rank_of_the_same_shard():
    import torch

    from outlast.train.torch.live_shards import FlatShards

    adam = functools.partial(torch.optim.Adam, lr=0.1)
    a, b = (FlatShards(_model(), adam, rank=r, world_size=2, shards=2) for r in (0, 1))
    with pytest.raises(ValueError, match="holds shard 1 of 2, and was sent the optimizer's state of shard 0 of 2"):
        b.load_state_dict(a.state_dict())


def test_bad_layouts_and_optimizers_say_what_to_pass():
    import torch

    from outlast.train.torch.live_shards import FlatShards

    adam = functools.partial(torch.optim.Adam, lr=0.1)
    with pytest.raises(ValueError, match="world's 3 ranks must be a whole number of replicas of 2"):
        FlatShards(_model(), adam, rank=0, world_size=3, shards=2)
    model = _model()
    with pytest.raises(TypeError, match="functools.partial"):
        FlatShards(model, torch.optim.Adam(model.parameters()), rank=0, world_size=2, shards=2)
    mixed = _model()
    mixed[2].double()
    with pytest.raises(TypeError, match="one flat tensor of one dtype"):
        FlatShards(mixed, adam, rank=0, world_size=2, shards=2)


def test_a_rank_that_took_its_state_in_a_gather_s_regroup_counts_the_report_its_sender_made_after():
    from outlast.train.torch.live_shards import reports_after_gather

    # Rank 1 was lost in the gather after a committed step: the group formed again before that step's report, and
    # rank 3 sent its replacement a count of 4. The survivors then reported the step: the next step's gather tells 5.
    assert reports_after_gather(4, [5, 4, 5, 5], took_state=True) == 5
    # A survivor keeps its own count, one that left the gather before the loss having reported the step already.
    assert reports_after_gather(4, [5, 4, 4, 4], took_state=False) == 4
    assert reports_after_gather(5, [5, 5, 5, 5], took_state=True) == 5


def test_a_rank_whose_gather_broke_joins_the_next_group_outside_the_except_clause():
    import sys
    from types import SimpleNamespace

    from outlast.train.live.group import GroupBroken
    from outlast.train.torch.live import LiveTraining

    class Breaks:
        def gather(self, group) -> None:
            raise GroupBroken("generation 0: rank 0's allgather failed")

    live = object.__new__(LiveTraining)  # its gather and join alone: no session, store or group
    live.sharded, live.rank = Breaks(), SimpleNamespace(group=object())
    live._took_state = live._settle_reports = False
    live._split = (SimpleNamespace(close=lambda: None), SimpleNamespace(close=lambda: None))
    handling: list = []
    # Inside the clause, the exception's traceback keeps the failed collective (and its gloo sockets) alive: a rank
    # whose part waits on this one would never come to the next group.
    live._join = lambda: handling.append(sys.exc_info()[1]) or 6
    live._gather(6)
    assert handling == [None]
