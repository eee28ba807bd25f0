"""outlast.data shards (what get_dataset_shard gives): as many rows on each rank, each row once across the ranks,
only a rank's own blocks read, walks that repeat, a bounded number of blocks held, positions that resume and
re-split, and reads from S3."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from outlast import data
from outlast.data.readers import ReadTask


def _parquet(tmp_path, files=4, groups=3, rows=10):
    for f in range(files):
        ids = list(range(f * groups * rows, (f + 1) * groups * rows))
        pq.write_table(pa.table({"id": ids}), tmp_path / f"part-{f}.parquet", row_group_size=rows)
    return data.read_parquet(str(tmp_path))


def _ids(walk):
    return [int(i) for batch in walk for i in batch["id"]]


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_every_row_is_read_once_across_the_ranks_as_many_rows_each(tmp_path, world_size):
    ds = _parquet(tmp_path)
    per_rank = [_ids(ds.shard(r, world_size, seed=4).iter_batches(batch_size=7)) for r in range(world_size)]
    assert {len(rows) for rows in per_rank} == {120 // world_size}
    seen = [i for rows in per_rank for i in rows]
    assert len(set(seen)) == len(seen) == 120 // world_size * world_size  # the last len % world_size left out


def test_a_rank_reads_only_its_own_blocks(tmp_path, monkeypatch):
    ds = _parquet(tmp_path)
    read: list[int | None] = []
    original = ReadTask.read
    monkeypatch.setattr(ReadTask, "read", lambda self: (read.append(self.row_group), original(self))[1])
    shard = ds.shard(1, 4)
    _ids(shard.iter_batches(batch_size=5))
    assert shard.source.blocks.blocks_read == 3 and len(read) == 3  # 12 row groups of 10 rows, 4 ranks of 30


def test_an_iterator_walks_again_each_epoch_with_the_same_rows_in_a_new_order(tmp_path):
    shard = _parquet(tmp_path).shard(0, 2, seed=11)
    batches = shard.iter_batches(batch_size=10)
    first, second = _ids(batches), _ids(batches)
    assert len(first) == 60 and first != second  # the blocks' order is shuffled per epoch
    again = _parquet(tmp_path).shard(0, 2, seed=11).iter_batches(batch_size=10)
    assert _ids(again) == first  # the same seed, the same epochs
    unshuffled = _parquet(tmp_path).shard(0, 2).iter_torch_batches(batch_size=10, device="cpu")
    a, b = ([int(i) for batch in unshuffled for i in batch["id"]] for _ in range(2))
    assert a == b == list(range(60))


def test_a_walk_holds_the_blocks_of_one_batch(tmp_path):
    shard = _parquet(tmp_path, files=8).shard(0, 1)
    rows = shard.source.blocks
    held = [len(rows._held) for _ in shard.iter_batches(batch_size=7)]
    assert rows.blocks_read == 24 and max(held) <= 2


def test_the_first_batch_reads_one_block(tmp_path):
    shard = _parquet(tmp_path).shard(0, 1)
    walk = iter(shard.iter_batches(batch_size=4))
    next(walk)
    assert shard.source.blocks.blocks_read == 1
    walk.close()


def test_a_position_resumes_at_the_next_batch(tmp_path):
    ds = _parquet(tmp_path)
    shards = [ds.shard(r, 2, seed=5) for r in range(2)]
    for s in shards:
        _ids(s.iter_batches(batch_size=8))  # epoch 0
    walks = [iter(s.iter_batches(batch_size=8)) for s in shards]
    taken = [[int(i) for _ in range(3) for i in next(w)["id"]] for w in walks]
    saved = {r: s.data_position() for r, s in enumerate(shards)}
    assert saved[1].epoch == 1 and saved[1].taken == 24
    fresh = ds.shard(1, 2, seed=5)
    fresh.resume_from(saved)
    rest = _ids(fresh.iter_batches(batch_size=8))
    whole = ds.shard(1, 2, seed=5)
    _ids(whole.iter_batches(batch_size=8))
    assert taken[1] + rest == _ids(whole.iter_batches(batch_size=8))
    assert fresh.data_position().epoch == 2  # the walk after the resumed one is the next epoch


def test_the_rest_of_an_epoch_is_split_again_across_a_new_world_and_back(tmp_path):
    ds = _parquet(tmp_path)
    old = [ds.shard(r, 3, seed=2) for r in range(3)]
    walks = [iter(s.iter_batches(batch_size=6)) for s in old]
    taken = [int(i) for _ in range(2) for w in walks for i in next(w)["id"]]
    saved = {r: s.data_position() for r, s in enumerate(old)}
    two = [ds.shard(r, 2, seed=2) for r in range(2)]
    for s in two:
        s.resume_from(saved)
    walks = [iter(s.iter_batches(batch_size=6)) for s in two]
    taken += [int(i) for w in walks for i in next(w)["id"]]
    saved = {r: s.data_position() for r, s in enumerate(two)}
    three = [ds.shard(r, 3, seed=2) for r in range(3)]
    for s in three:
        s.resume_from(saved)
    rest = [_ids(s.iter_batches(batch_size=6)) for s in three]
    assert max(map(len, rest)) - min(map(len, rest)) <= 1
    assert sorted(taken + [i for r in rest for i in r]) == list(range(120))


def test_a_bad_rank_is_refused(tmp_path):
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        _parquet(tmp_path).shard(2, 2)


def test_local_shuffle_is_reproducible_and_walks_again(tmp_path):
    ds = _parquet(tmp_path)
    kw = dict(batch_size=9, local_shuffle_buffer_size=50, local_shuffle_seed=1)
    whole = _ids(ds.iter_batches(**kw))
    assert whole == _ids(ds.iter_batches(**kw)) and whole != sorted(whole) and sorted(whole) == list(range(120))


def _uneven(tmp_path, sizes=(7, 13, 4, 9, 11, 5)):
    """One parquet file per entry of `sizes`, each a row group of that many rows: 49 rows, numbered in order."""
    first = 0
    for f, n in enumerate(sizes):
        pq.write_table(pa.table({"id": list(range(first, first + n))}), tmp_path / f"part-{f}.parquet")
        first += n
    return data.read_parquet(str(tmp_path))


def _train_shards(ds, world):
    return [ds.shard(r, world) for r in range(world)]


def test_by_block_keeps_runs_as_slices_and_puts_interleaved_rows_back_in_order():
    import numpy as np

    from outlast.data.block_rows import by_block

    starts = np.array([0, 7, 20, 24])
    groups, back = by_block(np.arange(5, 22), starts)
    assert [(b, list(r)) for b, r in groups] == [(0, [5, 6]), (1, list(range(13))), (2, [0, 1])] and back is None
    groups, back = by_block(np.array([21, 3, 8, 4]), starts)
    assert [(b, list(r)) for b, r in groups] == [(2, [1]), (0, [3, 4]), (1, [1])]
    assert list(np.concatenate([r for _, r in groups])[back]) == [1, 3, 1, 4]
    with pytest.raises(IndexError, match="outside the dataset's 24"):
        by_block(np.array([24]), starts)


def test_row_counts_come_from_footers_unless_a_transform_can_change_them(tmp_path):
    from outlast.data.block_rows import block_rows_known

    ds = _uneven(tmp_path)
    assert block_rows_known(ds) == [7, 13, 4, 9, 11, 5]
    assert block_rows_known(ds.map(lambda r: r).select_columns(["id"])) == [7, 13, 4, 9, 11, 5]
    assert block_rows_known(ds.filter(lambda r: r["id"] % 2 == 0)) is None
    assert len(ds.filter(lambda r: r["id"] % 2 == 0).rows()) == 25  # counted by reading each block once


@pytest.mark.parametrize("world", [2, 3, 4])
def test_get_dataset_shard_gives_every_rank_as_many_rows_and_batches_across_uneven_blocks(tmp_path, world):
    shards = _train_shards(_uneven(tmp_path), world)
    per_rank = [[[int(i) for i in b["id"]] for b in s.iter_batches(batch_size=4)] for s in shards]
    assert len({len(batches) for batches in per_rank}) == 1  # as many steps on every rank: no collective waits
    rows = [[i for b in batches for i in b] for batches in per_rank]
    assert {len(r) for r in rows} == {49 // world}
    assert sorted(i for r in rows for i in r) == list(range(49 // world * world))


def test_get_dataset_shard_reads_only_the_blocks_its_rows_are_in(tmp_path):
    # rows 0-15, 16-31 and 32-47 of blocks 0-6, 7-19, 20-23, 24-32, 33-43 and 44-48
    shards = _train_shards(_uneven(tmp_path), 3)
    for s in shards:
        list(s.iter_batches(batch_size=5))
    assert [s.source.blocks.blocks_read for s in shards] == [2, 3, 3]


def test_a_streamed_local_shuffle_keeps_to_its_window_and_resumes_at_the_next_batch(tmp_path):
    from outlast.train import data_position as dp

    ds = _uneven(tmp_path)
    kw = dict(batch_size=4, local_shuffle_buffer_size=8, local_shuffle_seed=3)
    whole = [int(i) for b in _train_shards(ds, 1)[0].iter_batches(**kw) for i in b["id"]]
    assert whole != sorted(whole) and sorted(whole) == list(range(49))
    assert all(sorted(whole[w:w + 8]) == list(range(w, min(w + 8, 49))) for w in range(0, 49, 8))
    shard = _train_shards(ds, 1)[0]
    walk = iter(shard.iter_batches(**kw))
    head = [int(i) for _ in range(3) for i in next(walk)["id"]]
    saved = {0: shard.data_position()}
    walk.close()
    fresh = _train_shards(ds, 1)[0]
    fresh.resume_from(saved)
    assert head + [int(i) for b in fresh.iter_batches(**kw) for i in b["id"]] == whole
    assert list(dp.rows_left(saved[0], 8)[0]) == whole[12:]


def test_a_streamed_epoch_split_again_at_another_world_reads_every_row_once(tmp_path):
    ds = _uneven(tmp_path).randomize_block_order(seed=5)
    three = _train_shards(ds, 3)
    walks = [iter(s.iter_batches(batch_size=3)) for s in three]
    taken = [int(i) for w in walks for i in next(w)["id"]]  # one step each, as ranks in step take
    saved = {r: s.data_position() for r, s in enumerate(three)}  # what a checkpoint of that step keeps
    two = _train_shards(ds, 2)
    for s in two:
        s.resume_from(saved)
    rest = [[int(i) for b in s.iter_batches(batch_size=3) for i in b["id"]] for s in two]
    assert len(rest[0]) - len(rest[1]) in (0, 1)
    assert sorted(taken + rest[0] + rest[1]) == sorted(
        i for s in _train_shards(ds, 3) for b in s.iter_batches(batch_size=3) for i in b["id"].tolist())


def test_a_fixed_size_list_column_is_one_array_per_batch_as_ray_gives(tmp_path):
    import numpy as np

    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 3)}),
                   tmp_path / "a.parquet", row_group_size=8)
    batches = list(data.read_parquet(str(tmp_path)).iter_torch_batches(batch_size=6, device="cpu"))
    assert [tuple(b["x"].shape) for b in batches] == [(6, 3), (6, 3), (6, 3), (2, 3)]
    assert np.array_equal(np.concatenate([b["x"].numpy() for b in batches]), x)
    shard = _train_shards(data.read_parquet(str(tmp_path)), 2)[1]
    assert np.array_equal(np.concatenate([b["x"] for b in shard.iter_batches(batch_size=4)]), x[10:])


def test_reads_from_s3(s3, tmp_path):
    import boto3
    import io

    client = boto3.client("s3")
    for f in range(2):
        buffer = io.BytesIO()
        pq.write_table(pa.table({"id": list(range(f * 20, f * 20 + 20))}), buffer, row_group_size=5)
        client.put_object(Bucket="runs", Key=f"data/part-{f}.parquet", Body=buffer.getvalue())
    client.put_object(Bucket="runs", Key="csv/a.csv", Body=b"a,b\n1,2\n3,4\n")
    ds = data.read_parquet("s3://runs/data/")
    assert ds.num_blocks() == 8 and ds.count() == 40
    assert sorted(_ids(ds.shard(0, 2).iter_batches(batch_size=3)) + _ids(ds.shard(1, 2).iter_batches())) == \
        list(range(40))
    assert [r["a"] for r in data.read_csv("s3://runs/csv/a.csv").take_all()] == [1, 3]
    with pytest.raises(data.DataReadError, match="s3://runs/missing.*no such file"):
        data.read_csv("s3://runs/missing/")
