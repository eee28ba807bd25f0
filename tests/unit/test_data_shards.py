import numpy as np
import pytest
import torch

from outlast.train.data import DataConfig, DataShard, shard_indices, to_source


def shard(data, rank=0, world=1, split=True):
    source = to_source("train", data)
    return DataShard("train", source, rank, world, split)


def test_split_shards_are_equal_contiguous_and_disjoint_leaving_the_remainder_out():
    parts = [list(shard_indices(10, r, 3, True)) for r in range(3)]
    assert parts == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert list(shard_indices(10, 2, 3, False)) == list(range(10))
    assert list(shard_indices(2, 1, 4, True)) == []


def test_data_config_splits_all_by_default_or_the_named_datasets():
    assert DataConfig().splits("validation")
    assert not DataConfig(datasets_to_split=["train"]).splits("validation")
    with pytest.raises(ValueError, match="'all' or a list"):
        DataConfig(datasets_to_split="train")


def test_a_dict_of_columns_gives_numpy_batches_and_tensor_batches():
    data = {"x": np.arange(10, dtype=np.float32).reshape(5, 2), "y": np.arange(5)}
    batches = list(shard(data, rank=1, world=2).iter_batches(batch_size=1))
    assert [b["y"].tolist() for b in batches] == [[2], [3]]
    (tb,) = list(shard(data).iter_torch_batches(batch_size=8, device="cpu", dtypes=torch.float64))
    assert tb["x"].shape == (5, 2) and tb["y"].dtype == torch.float64


def test_a_torch_dataset_of_tuples_is_collated_as_a_dataloader_would():
    ds = torch.utils.data.TensorDataset(torch.arange(6.0).unsqueeze(1), torch.arange(6))
    x, y = next(iter(shard(ds, rank=0, world=2).iter_torch_batches(batch_size=2, device="cpu")))
    assert x.tolist() == [[0.0], [1.0]] and y.tolist() == [0, 1]
    numpy_batch = next(iter(shard(ds).iter_batches(batch_size=4)))
    assert sorted(numpy_batch) == ["0", "1"] and numpy_batch["1"].tolist() == [0, 1, 2, 3]


def test_rows_arrays_and_lists_are_read_with_ray_data_column_names():
    assert next(iter(shard(np.ones((3, 2))).iter_batches()))["data"].shape == (3, 2)
    assert next(iter(shard([1, 2, 3]).iter_batches()))["item"].tolist() == [1, 2, 3]
    assert list(shard([{"a": 1}, {"a": 2}]).iter_rows()) == [{"a": 1}, {"a": 2}]
    with pytest.raises(ValueError, match="same keys"):
        to_source("train", [{"a": 1}, {"b": 2}])


def test_a_hugging_face_dataset_is_read_by_columns_text_staying_numpy():
    import datasets  # installed with outlast[test]
    ds = datasets.Dataset.from_dict({"text": ["a", "b", "c", "d"], "label": [0, 1, 0, 1], "emb": [[1.0, 2.0]] * 4})
    (batch,) = list(shard(ds, rank=1, world=2).iter_batches(batch_size=10))
    assert batch["text"].tolist() == ["c", "d"] and batch["label"].tolist() == [0, 1]
    (tb,) = list(shard(ds, rank=1, world=2).iter_torch_batches(batch_size=10, device="cpu"))
    assert tb["emb"].shape == (2, 2) and tb["label"].dtype == torch.int64 and tb["text"].tolist() == ["c", "d"]
    assert next(iter(shard(ds).iter_rows()))["text"] == "a"


def test_drop_last_and_a_seeded_local_shuffle_differ_per_epoch_but_repeat_across_runs():
    data = {"i": np.arange(10)}
    assert len(list(shard(data).iter_batches(batch_size=4, drop_last=True))) == 2
    a, b = shard(data), shard(data)
    epochs_a = [np.concatenate([x["i"] for x in a.iter_batches(local_shuffle_buffer_size=10, local_shuffle_seed=1)])
                for _ in range(2)]
    epochs_b = [np.concatenate([x["i"] for x in b.iter_batches(local_shuffle_buffer_size=10, local_shuffle_seed=1)])
                for _ in range(2)]
    assert [e.tolist() for e in epochs_a] == [e.tolist() for e in epochs_b]
    assert epochs_a[0].tolist() != epochs_a[1].tolist() and sorted(epochs_a[0]) == list(range(10))


def test_what_outlast_cannot_read_is_refused_with_what_to_pass_instead():
    class FakeRayDataset:
        pass

    FakeRayDataset.__module__ = "ray.data.dataset"
    with pytest.raises(TypeError, match="Ray Data dataset.*torch Dataset"):
        to_source("train", FakeRayDataset())
    with pytest.raises(TypeError, match="torch Dataset"):
        to_source("train", 42)
    with pytest.raises(AttributeError, match="iter_batches, iter_torch_batches"):
        shard([1]).to_tf()


def test_a_shard_materializes_to_itself_and_reads_as_one_pandas_frame_as_ray_datas_does():
    rows = [{"x": x, "y": x + 1} for x in range(5)]
    part = shard(rows, rank=1, world=2)
    assert part.materialize() is part
    frame = part.materialize().to_pandas()
    assert frame.to_dict("records") == [{"x": 2, "y": 3}, {"x": 3, "y": 4}]
    assert shard([], rank=0, world=1).to_pandas().empty
