import json
from collections import Counter

import numpy as np
import pytest

from outlast.train import data_position as dp
from outlast.train import positions
from outlast.train.data import DataShard, to_source


def shard(n, rank=0, world=1, split=True):
    return DataShard("train", to_source("train", {"i": np.arange(n)}), rank, world, split)


def walk(it, stop_after=None):
    """The rows of each batch of one walk, stopping (as a killed rank does) after `stop_after` batches."""
    out = []
    for batch in it:
        out.append(batch["i"].tolist())
        if stop_after is not None and len(out) == stop_after:
            break
    return out


def saved_positions(shards, stop_after, **kwargs):
    """Every rank reads `stop_after` batches of an epoch and reports: what each has read, and its position."""
    read, saved = [], {}
    for s in shards:
        it = iter(s.iter_batches(**kwargs))
        for _ in range(stop_after):
            read.extend(next(it)["i"].tolist())
        saved[s.rank] = s.data_position()
        it.close()  # the rank dies here
    return read, saved


def resumed(n, saved, world, split=True, **kwargs):
    shards = [shard(n, r, world, split) for r in range(world)]
    read = []
    for s in shards:
        s.resume_from(saved)
        read.extend(row for b in walk(s.iter_batches(**kwargs)) for row in b)
    return shards, read


def test_every_iterator_can_be_walked_again_with_the_same_rows_each_epoch():
    s = shard(10)
    for it in (s.iter_batches(batch_size=4), s.iter_torch_batches(batch_size=4, device="cpu")):
        first, second = [walk(it) for _ in range(2)]
        assert first == second == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    rows = s.iter_rows()
    assert [r["i"] for r in rows] == [r["i"] for r in rows] == list(range(10))


def test_a_shuffled_iterator_walked_again_reads_every_row_once_in_a_new_order():
    it = shard(20).iter_batches(batch_size=5, local_shuffle_buffer_size=20, local_shuffle_seed=3)
    first, second = [sum(walk(it), []) for _ in range(2)]
    assert sorted(first) == sorted(second) == list(range(20)) and first != second


def test_a_walk_left_by_break_ends_its_epoch_as_a_new_walk_starts_the_next():
    s = shard(10)
    it = s.iter_batches(batch_size=2)
    assert walk(it, stop_after=1) == [[0, 1]]
    assert s.data_position().epoch == 1 and s.data_position().taken == 0
    assert walk(it) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_same_world_goes_on_at_the_next_batch_with_the_same_rows_as_a_run_without_faults(shuffle):
    kwargs = dict(batch_size=2, local_shuffle_buffer_size=8 if shuffle else None, local_shuffle_seed=5)
    whole = [walk(shard(12, r, 3).iter_batches(**kwargs)) for r in range(3)]
    read, saved = saved_positions([shard(12, r, 3) for r in range(3)], 1, **kwargs)
    shards = [shard(12, r, 3) for r in range(3)]
    for s in shards:
        s.resume_from(saved)
    assert [[b for b in walk(s.iter_batches(**kwargs))] for s in shards] == [w[1:] for w in whole]
    assert all(s.data_position().epoch == 1 for s in shards)  # the walk ended: the next is epoch 1


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_resize_three_two_three_reads_every_row_exactly_once_in_the_epoch(shuffle):
    kwargs = dict(batch_size=2, local_shuffle_buffer_size=64 if shuffle else None, local_shuffle_seed=None)
    n = 31  # 30 rows in the epoch's first split of 3
    read_a, saved = saved_positions([shard(n, r, 3) for r in range(3)], 2, **kwargs)
    shards2 = [shard(n, r, 2) for r in range(2)]
    for s in shards2:
        s.resume_from(saved)
    read_b, saved2 = saved_positions(shards2, 1, **kwargs)
    assert {p.generation for p in saved2.values()} == {1}
    shards3, read_c = resumed(n, saved2, 3, **kwargs)
    counts = Counter(read_a + read_b + read_c)
    assert set(counts) == set(range(30)) and set(counts.values()) == {1}


def test_ranks_of_a_resplit_rest_take_as_many_steps_the_extra_rows_riding_in_their_last_batch():
    _, saved = saved_positions([shard(9, r, 3) for r in range(3)], 1, batch_size=1)  # 6 rows left of 9
    steps = []
    rows = []
    for r in range(4):  # 6 rows between 4 ranks: 2, 2, 1, 1
        s = shard(9, r, 4)
        s.resume_from(saved)
        batches = walk(s.iter_batches(batch_size=2))
        steps.append(len(batches))
        rows += sum(batches, [])
    assert steps == [1, 1, 1, 1]
    assert Counter(rows + [0, 3, 6]) == Counter(range(9))


def test_a_position_saved_after_the_epochs_last_batch_resumes_to_an_empty_rest_then_the_next_epoch():
    s = shard(4)
    it = iter(s.iter_batches(batch_size=2))
    next(it), next(it)
    saved = {0: s.data_position()}
    assert saved[0].taken == 4
    t = shard(4)
    t.resume_from(saved)
    assert walk(t.iter_batches(batch_size=2)) == []
    assert walk(t.iter_batches(batch_size=2)) == [[0, 1], [2, 3]] and t.data_position().epoch == 2


def test_a_position_saved_between_epochs_starts_the_next_epoch():
    s = shard(4)
    walk(s.iter_batches(batch_size=2))
    t = shard(4)
    t.resume_from({0: s.data_position()})
    assert walk(t.iter_batches(batch_size=2)) == [[0, 1], [2, 3]] and t.data_position().epoch == 2


def test_one_rank_resumes_alone_and_fewer_rows_than_ranks_are_left_out():
    _, saved = saved_positions([shard(8, r, 2) for r in range(2)], 1, batch_size=3)  # 1 + 1 rows left
    _, read = resumed(8, saved, 1, batch_size=3)
    assert sorted(read) == [3, 7]
    assert dp.batch_bounds(rows_left=1, least_left=0, batch_size=3, drop_last=False) == []


def test_a_missing_rank_reads_the_epoch_again_from_its_start():
    _, saved = saved_positions([shard(8, r, 2) for r in range(2)], 1, batch_size=2)
    del saved[1]
    t = shard(8, 0, 2)
    t.resume_from(saved)
    assert walk(t.iter_batches(batch_size=2)) == [[0, 1], [2, 3]] and t.data_position().epoch == 1


def test_an_unsplit_dataset_goes_on_from_its_own_place_at_any_world_size():
    _, saved = saved_positions([shard(6, r, 2, split=False) for r in range(2)], 2, batch_size=2)
    _, read = resumed(6, saved, 3, split=False, batch_size=2)
    assert read == [4, 5] * 3


def test_a_document_round_trips_and_stays_small():
    _, saved = saved_positions([shard(10**6, r, 3) for r in range(3)], 1, batch_size=2)
    text = dp.encode(3, 0, {"dataset:train": saved[0]})
    assert dp.decode(text, "here") == {"dataset:train": saved[0]} and len(text) < 300


@pytest.mark.parametrize("text, fault", [
    ("not json", "not JSON"),
    (json.dumps({"version": 99, "datasets": {}}), "version 99.*start the run afresh"),
    (json.dumps({"version": dp.VERSION}), "no 'datasets'"),
    (json.dumps({"version": dp.VERSION, "datasets": {"x": {"epoch": 0}}}), "dataset 'x'.*malformed"),
    (json.dumps({"version": dp.VERSION, "datasets": {"x": {"epoch": -1, "length": 1, "split": True, "shuffle": False,
                                                  "world": 1, "rank": 0, "seed": 0, "taken": 0, "past": []}}}),
     "malformed"),
    (json.dumps({"version": dp.VERSION, "datasets": {"x": {"epoch": 0, "length": 1, "split": True, "shuffle": False,
                                                  "world": 1, "rank": 3, "seed": 0, "taken": 0, "past": [], "order_seed": None,
                                                  "strided": False}}}),
     "outside its world"),
    ("x" * (dp.MAX_BYTES + 1), "over"),
])
def test_a_bad_document_is_refused_naming_where_and_what(text, fault):
    with pytest.raises(dp.DataPositionError, match=f"rank 2.*{fault}"):
        dp.decode(text, "rank 2")


def test_positions_from_disagreeing_ranks_are_refused():
    _, saved = saved_positions([shard(8, r, 2) for r in range(2)], 1, batch_size=2)
    saved[1] = dp.Position(5, 8, True, False, 2, 1, 0)
    with pytest.raises(dp.DataPositionError, match="disagrees"):
        dp.resume(saved, 0, 2, 0)


def test_a_tracked_shard_resumes_from_the_restored_documents_on_its_first_walk():
    a = shard(8, 0, 1)
    walk(a.iter_batches(batch_size=2), stop_after=None)
    it = iter(a.iter_batches(batch_size=2))
    next(it)
    text = dp.encode(1, 0, {"dataset:train": a.data_position()})
    positions.start(lambda: {0: text})
    try:
        b = shard(8, 0, 1)
        positions.track("dataset:train", b)
        assert walk(b.iter_batches(batch_size=2)) == [[2, 3], [4, 5], [6, 7]]
        assert json.loads(positions.document(1, 0))["datasets"]["dataset:train"]["epoch"] == 2
    finally:
        positions.start(None)


def loader_rows(batches, dataset_len, stop_after=None, num_workers=0):
    """One walk of a DataLoader read through `batches`, as prepare_data_loader builds it."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from outlast.train.torch.helpers import _DeviceLoader

    loader = _DeviceLoader(DataLoader(TensorDataset(torch.arange(dataset_len)), batch_sampler=batches,
                                      num_workers=num_workers), None, batches)
    out = []
    for (batch,) in loader:
        out.append(batch.tolist())
        if stop_after is not None and len(out) == stop_after:
            break
    return out


def epoch_batches(rank, world, n=24, batch_size=2):
    from outlast.train.torch.epoch_batches import EpochBatches

    return EpochBatches(n, rank, world, batch_size, shuffle=True, drop_last=False, seed=7)


def test_a_prepared_loader_counts_what_the_loop_took_not_what_its_workers_prefetched():
    b = epoch_batches(0, 1)
    whole = loader_rows(epoch_batches(0, 1), 24)
    assert loader_rows(b, 24, stop_after=2, num_workers=2)  # the workers read ahead of the loop
    assert b.data_position().taken == 0 and b.data_position().epoch == 1  # the walk was left: epoch 0 ended
    c = epoch_batches(0, 1)
    rows = loader_rows(c, 24, stop_after=None)
    assert rows == whole and len(c) == 12
    assert sorted(sum(whole, [])) == list(range(24))


def read_then_die(batches, n, count):
    """A rank reads `count` batches through its prepared loader and reports: its rows and its position."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from outlast.train.torch.helpers import _DeviceLoader

    loader = iter(_DeviceLoader(DataLoader(TensorDataset(torch.arange(n)), batch_sampler=batches), None, batches))
    rows = [row for _ in range(count) for row in next(loader)[0].tolist()]
    return rows, batches.data_position()  # saved in the loop body, the walk under way


def test_a_prepared_loader_resized_three_two_three_reads_every_row_once_in_the_epoch():
    read, saved = [], {}
    for r in range(3):
        rows, saved[r] = read_then_die(epoch_batches(r, 3), 24, 2)
        read += rows
    saved2 = {}
    for r in range(2):
        b = epoch_batches(r, 2)
        b.resume_from(saved)
        rows, saved2[r] = read_then_die(b, 24, 1)
        read += rows
    for r in range(3):
        b = epoch_batches(r, 3)
        b.resume_from(saved2)
        read += sum(loader_rows(b, 24), [])
        assert b.data_position().epoch == 1
    assert Counter(read) == Counter(range(24))


def test_a_dataset_of_another_length_than_saved_reads_the_saved_epoch_again_from_its_start():
    _, saved = saved_positions([shard(8, r, 2) for r in range(2)], 1, batch_size=2)
    t = shard(10, 0, 2)
    t.resume_from(saved)
    assert walk(t.iter_batches(batch_size=2)) == [[0, 1], [2, 3], [4]] and t.data_position().epoch == 1


def test_a_transformers_trainer_takes_a_shards_batches_and_reads_them_every_epoch():
    from outlast.train.huggingface.transformers import _is_batches, _loader

    batches = shard(6).iter_torch_batches(batch_size=2, device="cpu")
    assert _is_batches(batches)
    loader = _loader(batches)
    assert [[b["i"].tolist() for b in loader] for _ in range(2)] == [[[0, 1], [2, 3], [4, 5]]] * 2


def test_a_loader_built_again_each_epoch_goes_on_as_one_loader_and_resumes_so():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from outlast.train.torch.helpers import prepare_data_loader

    dataset = TensorDataset(torch.arange(8))

    def epoch(loader=None, stop_after=None):
        return walk(({"i": b} for (b,) in (loader or prepare_data_loader(
            DataLoader(dataset, batch_size=2, shuffle=True), move_to_device=False))), stop_after)

    positions.start(None)
    try:
        whole = [epoch() for _ in range(4)]  # four epochs, a loader built for each
        assert whole[0] != whole[1] and all(sorted(sum(e, [])) == list(range(8)) for e in whole)
        assert list(json.loads(positions.document(1, 0))["datasets"]) == ["loader:0"]
        positions.start(None)
        assert [epoch() for _ in range(3)] == whole[:3]
        loader = iter(prepare_data_loader(DataLoader(dataset, batch_size=2, shuffle=True), move_to_device=False))
        assert next(loader)[0].tolist() == whole[3][0]
        text = positions.document(1, 0)  # reported in epoch 3's loop body, then the rank dies
        positions.start(lambda: {0: text})
        assert epoch() == whole[3][1:]
    finally:
        positions.start(None)


def sampler_rows(n, rank, world, shuffle, epoch, seed=7, drop_last=False):
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_prepared_loader_gives_each_rank_a_distributed_samplers_rows_in_its_order(world, shuffle):
    from outlast.train.torch.epoch_batches import EpochBatches

    for r in range(world):
        b = EpochBatches(24, r, world, 5, shuffle=shuffle, drop_last=False, seed=7)
        for epoch in (0, 3):
            b.set_epoch(epoch)
            rows = loader_rows(b, 24)
            want = sampler_rows(24, r, world, shuffle, epoch)
            assert rows == [want[i:i + 5] for i in range(0, len(want), 5)]
    assert sampler_rows(24, 0, 2, True, 0) != sampler_rows(24, 0, 2, True, 3)  # the epochs are permuted apart


def test_where_the_length_does_not_divide_a_prepared_loader_leaves_out_what_a_sampler_would_repeat():
    from outlast.train.torch.epoch_batches import EpochBatches

    read = []
    for r in range(3):
        rows = sum(loader_rows(EpochBatches(25, r, 3, 4, shuffle=True, drop_last=False, seed=7), 25), [])
        # A DistributedSampler pads to 27 rows with the order's first two; with drop_last it leaves out the last.
        assert len(sampler_rows(25, r, 3, True, 0)) == 9
        assert rows == sampler_rows(25, r, 3, True, 0, drop_last=True)
        read += rows
    assert len(read) == len(set(read)) == 24


def test_a_prepared_loader_resized_at_an_epochs_start_gives_the_samplers_rows_at_the_new_size():
    saved = {}
    for r in range(3):
        b = epoch_batches(r, 3)
        loader_rows(b, 24)
        saved[r] = b.data_position()  # reported after the walk: the next epoch, not begun
    for r in range(2):
        b = epoch_batches(r, 2)
        b.resume_from(saved)
        assert sum(loader_rows(b, 24), []) == sampler_rows(24, r, 2, True, 1)


def _loader_position(epoch: int, taken: int, rank: int = 0) -> dp.Position:
    """prepare_data_loader's place: rows dealt in turn from one shuffled order, 2 ranks, 48 rows."""
    return dp.Position(epoch, 48, True, False, 2, rank, 0, taken, order_seed=epoch, strided=True)


def test_the_step_in_flights_start_is_the_place_at_the_last_commit_or_the_start_of_a_newer_epochs_walk():
    at_commit = dp.encode(2, 1, {"loader:0": _loader_position(0, 12, 1)})
    mid = dp.encode(2, 1, {"loader:0": _loader_position(0, 16, 1)})
    assert positions.step_start(at_commit, mid) == at_commit  # the batch of the step in flight is given back
    # The step before was the epoch's last; the step in flight began the next epoch's walk: at its start.
    last = dp.encode(2, 1, {"loader:0": _loader_position(0, 24, 1)})
    begun = dp.encode(2, 1, {"loader:0": _loader_position(1, 4, 1)})
    [(_, p)] = dp.decode(positions.step_start(last, begun), "test").items()
    assert (p.epoch, p.taken, p.rank) == (1, 0, 1)
    assert positions.step_start("", begun) == begun and positions.step_start(last, "") == last


def test_a_replacement_takes_up_a_survivors_place_dealt_to_every_rank_and_leaves_an_unsplittable_reader_alone():
    shard = dp.Position(0, 48, True, True, 2, 0, 1234, 8)  # get_dataset_shard's: each rank shuffles with its seed
    sent = dp.encode(2, 0, {"loader:0": _loader_position(0, 12), "shard:0": shard})
    positions.start(None)
    try:
        assert positions.take_up(sent) == ["shard:0"]
        saved = positions._read_saved()
        assert set(saved) == {"loader:0"} and sorted(saved["loader:0"]) == [0, 1]
        assert all(p.taken == 12 and p.rank == r for r, p in saved["loader:0"].items())
    finally:
        positions.start(None)


def test_a_replacement_takes_up_a_shard_shuffled_with_the_runs_seed_at_the_lost_ranks_seed():
    base = dp.run_seed("/storage", "run")
    assert base == dp.run_seed("/storage", "run") != dp.run_seed("/storage", "other")
    drawn = dp.Position(1, 48, True, True, 3, 2, dp.rank_seed(base, 1, 0, 2), 8)  # rank 2's, from the run's seed
    loops = dp.Position(1, 48, True, True, 3, 2, 7 + 1, 8)  # local_shuffle_seed=7 in epoch 1: every rank's
    random = dp.Position(1, 48, True, True, 3, 2, 99, 8, past=(dp.Generation(2, (4, 4), (5, 6)),))
    sent = dp.encode(3, 2, {"dataset:a": drawn, "dataset:b": loops, "dataset:c": random})
    positions.start(None)
    try:
        assert positions.take_up(sent, base) == ["dataset:c"]  # a later generation's seed not from the run's
        saved = positions._read_saved()
        assert {r: p.seed for r, p in saved["dataset:a"].items()} == {r: dp.rank_seed(base, 1, 0, r) for r in range(3)}
        assert {p.seed for p in saved["dataset:b"].values()} == {8}
        assert all(p.taken == 8 and p.rank == r for r, p in saved["dataset:a"].items())
        # Without the run's seed, no shuffled shard's seed can be told.
        assert positions.take_up(sent, None) == ["dataset:a", "dataset:b", "dataset:c"]
    finally:
        positions.start(None)


def test_a_replacement_of_a_shard_reads_the_rest_of_the_lost_ranks_share_in_its_order():
    """The lost rank's walk, and the walk of a replacement placed from a survivor's position: together its share."""
    import numpy as np

    from outlast.train import data

    base = dp.run_seed("/s", "run")

    def shard(rank):
        return data.DataShard("train", data.to_source("train", {"i": np.arange(48)}), rank, 3, True, base)

    lost = [b["i"].tolist() for b in shard(1).iter_batches(batch_size=4, local_shuffle_buffer_size=48)]
    survivor = shard(0)
    walk = iter(survivor.iter_batches(batch_size=4, local_shuffle_buffer_size=48))
    next(walk), next(walk)
    positions.start(None)
    try:
        positions.take_up(dp.encode(3, 0, {"dataset:train": survivor.data_position()}), base)
        replacement = shard(1)
        positions.track("dataset:train", replacement)
        rest = [b["i"].tolist() for b in replacement.iter_batches(batch_size=4, local_shuffle_buffer_size=48)]
    finally:
        positions.start(None)
    assert rest == lost[2:] and sorted(sum(lost, [])) == list(range(16, 32))


def test_a_live_grow_splits_the_rest_of_a_walk_under_way_and_the_joiner_takes_up_its_share():
    """Ranks 0 and 1 of 2 are two batches into their shuffled shares; the world grows to 3: each splits the rest
    from its own place (`positions.regroup`), the joiner takes up its place from rank 0's (`take_up`), and the
    three read the rest of the epoch in lockstep, every row once."""
    import numpy as np

    from outlast.train import data

    base = dp.run_seed("/s", "grow")

    def shard(rank, world):
        return data.DataShard("train", data.to_source("train", {"i": np.arange(48)}), rank, world, True, base)

    read: list[int] = []
    old = [shard(r, 2) for r in range(2)]
    walks = [iter(s.iter_batches(batch_size=4, local_shuffle_buffer_size=48)) for s in old]
    for _ in range(2):
        read += [i for w in walks for i in next(w)["i"].tolist()]
    places = [s.data_position() for s in old]
    for r, s in enumerate(old):
        positions.start(None)
        positions.track("dataset:train", s)
        assert positions.regroup(dp.encode(2, r, {"dataset:train": places[r]}), r, 3, base) == []
    positions.start(None)
    try:
        positions.take_up(dp.encode(3, 0, {"dataset:train": old[0].data_position()}), base)
        joiner = shard(2, 3)
        positions.track("dataset:train", joiner)
        walks.append(iter(joiner.iter_batches(batch_size=4, local_shuffle_buffer_size=48)))
        rest = [[b["i"].tolist() for b in w] for w in walks]
    finally:
        positions.start(None)
    assert len({len(r) for r in rest}) == 1  # as many batches on every rank
    read += [i for r in rest for b in r for i in b]
    assert sorted(read) == list(range(48))


def test_a_live_shrink_splits_the_rest_from_the_step_in_flights_start_and_a_later_replacement_takes_it_up():
    """Ranks 0, 1 and 2 of 3 read two batches of their shuffled shares and took a third (the step in flight) when
    rank 1's node is lost with no room elsewhere: the step is thrown away, and ranks 0 and 2, numbered 0 and 1 of 2
    from here, split the rest from every rank's place at that step's start (`positions.regroup`), their walks under
    way going on with the new shares. Then the group's rank 1 dies and its replacement takes up its place from rank
    0's (`take_up`). Every row is read once in the epoch; a checkpoint's documents, named by the ranks that
    reported them (0 and 2), place the ranks they name (0 and 1 of 2)."""
    from outlast.train import data

    base = dp.run_seed("/s", "shrink")

    def shard(rank, world):
        return data.DataShard("train", data.to_source("train", {"i": np.arange(60)}), rank, world, True, base)

    read: list[int] = []
    old = [shard(r, 3) for r in range(3)]
    walks = [iter(s.iter_batches(batch_size=4, local_shuffle_buffer_size=60)) for s in old]
    for _ in range(2):
        read += [i for w in walks for i in next(w)["i"].tolist()]
    starts = [s.data_position() for s in old]
    for w in walks:
        next(w)  # the step in flight: thrown away, its rows read again from the new split
    survivors = {0: (old[0], walks[0]), 1: (old[2], walks[2])}  # the group's new rank -> the old rank's reader
    for new_rank, (s, _) in survivors.items():
        positions.start(None)
        positions.track("dataset:train", s)
        assert positions.regroup(dp.encode(3, s.rank, {"dataset:train": starts[s.rank]}), new_rank, 2, base) == []
    positions.start(None)
    read += [i for _, w in survivors.values() for i in next(w)["i"].tolist()]  # the step again, on the new split
    documents = {0: dp.encode(2, 0, {"dataset:train": survivors[0][0].data_position()}),
                 2: dp.encode(2, 1, {"dataset:train": survivors[1][0].data_position()})}
    try:
        positions.take_up(documents[0], base)  # the group's rank 1 lost: its replacement
        replacement = shard(1, 2)
        positions.track("dataset:train", replacement)
        rest = [[b["i"].tolist() for b in w] for w in (survivors[0][1], iter(
            replacement.iter_batches(batch_size=4, local_shuffle_buffer_size=60)))]
        positions.start(lambda: documents)  # a restore of the checkpoint the two reported
        restored = shard(1, 2)
        positions.track("dataset:train", restored)
        assert [b["i"].tolist() for b in restored.iter_batches(batch_size=4, local_shuffle_buffer_size=60)] == rest[1]
    finally:
        positions.start(None)
    assert len({len(r) for r in rest}) == 1
    read += [i for r in rest for b in r for i in b]
    assert sorted(read) == list(range(60))
