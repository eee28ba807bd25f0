"""outlast.data: each read and transform against small files, and each bad input's error."""

from __future__ import annotations

import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import pytest
from PIL import Image as pil

from outlast import data
from outlast.data import DataReadError, UserFunctionError


def _parquet(tmp_path, files=3, groups=2, rows=5):
    for f in range(files):
        ids = list(range(f * groups * rows, (f + 1) * groups * rows))
        pq.write_table(pa.table({"id": ids, "x": [float(i) for i in ids]}), tmp_path / f"part-{f}.parquet",
                       row_group_size=rows)
    return tmp_path


def test_read_parquet_makes_one_block_per_row_group_and_reads_nothing_up_front(tmp_path):
    ds = data.read_parquet(str(_parquet(tmp_path)))
    assert ds.num_blocks() == 6 and ds.count() == 30
    assert sorted(r["id"] for r in ds.take_all()) == list(range(30))
    assert data.read_parquet(str(tmp_path), columns=["x"]).schema().names == ["x"]


def test_read_csv_json_text_numpy_binary(tmp_path):
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "a.csv").write_text("a,b\n1,2\n3,4\n")
    (tmp_path / "csv" / "b.csv").write_text("a,b\n5,6\n")
    assert [r["a"] for r in data.read_csv(str(tmp_path / "csv")).take_all()] == [1, 3, 5]
    (tmp_path / "j.jsonl").write_text("\n".join(json.dumps({"k": i}) for i in range(4)))
    assert data.read_json(str(tmp_path / "j.jsonl")).count() == 4
    (tmp_path / "arr.json").write_text(json.dumps([{"k": 1}, {"k": 2}]))
    assert [r["k"] for r in data.read_json(str(tmp_path / "arr.json"), lines=False).take_all()] == [1, 2]
    (tmp_path / "t.txt").write_text("one\ntwo\n\nthree\n")
    assert [r["text"] for r in data.read_text(str(tmp_path / "t.txt")).take_all()] == ["one", "two", "three"]
    np.save(tmp_path / "m.npy", np.arange(12).reshape(4, 3))
    batch = next(iter(data.read_numpy(str(tmp_path / "m.npy")).iter_batches(batch_size=None)))
    assert batch["data"].shape == (4, 3) and batch["data"][3].tolist() == [9, 10, 11]
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.bin").write_bytes(b"\x00\x01")
    rows = data.read_binary_files(str(tmp_path / "bin"), include_paths=True).take_all()
    assert rows[0]["bytes"] == b"\x00\x01" and rows[0]["path"].endswith("x.bin")


def test_read_images_without_pillow_says_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # what an environment without Pillow imports
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(ImportError, match="pip install pillow"):
        data.read_images("/nowhere")


def test_read_images_names_a_path_that_is_not_there():
    with pytest.raises(DataReadError, match="/nowhere"):
        data.read_images("/nowhere")


def test_from_items_pandas_numpy_torch():
    import pandas as pd
    import torch

    assert data.from_items([1, 2, 3]).take(2) == [{"item": 1}, {"item": 2}]
    assert data.from_items([{"a": i} for i in range(40)], override_num_blocks=4).num_blocks() == 4
    assert data.from_pandas(pd.DataFrame({"a": [1, 2]})).count() == 2
    batch = next(iter(data.from_numpy(np.ones((6, 2, 2))).iter_batches(batch_size=4)))
    assert batch["data"].shape == (4, 2, 2)
    ds = data.from_torch(torch.utils.data.TensorDataset(torch.arange(5)))
    assert ds.count() == 5


def test_map_filter_flat_map_and_columns():
    ds = data.from_items([{"a": i} for i in range(10)], override_num_blocks=3)
    assert [r["b"] for r in ds.map(lambda r: {"b": r["a"] * 2}).take(3)] == [0, 2, 4]
    assert ds.filter(lambda r: r["a"] % 2 == 0).count() == 5
    assert ds.flat_map(lambda r: [r, r]).count() == 20
    added = ds.add_column("c", lambda df: df["a"] + 1)
    assert added.columns() == ["a", "c"] and added.take(1)[0]["c"] == 1
    assert added.drop_columns(["a"]).columns() == ["c"]
    assert added.select_columns(["c"]).columns() == ["c"]


@pytest.mark.parametrize("fmt", ["default", "numpy", "pandas", "pyarrow"])
def test_map_batches_in_each_batch_format(fmt):
    def double(batch):
        if fmt == "pyarrow":
            return pa.table({"a": pa.compute.multiply(batch["a"], 2)})
        batch["a"] = batch["a"] * 2
        return batch

    ds = data.from_items([{"a": i} for i in range(10)], override_num_blocks=2)
    assert [r["a"] for r in ds.map_batches(double, batch_format=fmt, batch_size=3).take_all()] == \
        [2 * i for i in range(10)]


def test_map_batches_with_a_callable_class_builds_it_once():
    built = []

    class AddOffset:
        def __init__(self, offset):
            built.append(offset)
            self.offset = offset

        def __call__(self, batch):
            return {"a": batch["a"] + self.offset}

    ds = data.from_items([{"a": i} for i in range(10)], override_num_blocks=5)
    out = ds.map_batches(AddOffset, fn_constructor_args=(100,), concurrency=2)
    assert [r["a"] for r in out.take_all()] == list(range(100, 110)) and built == [100]


def test_shuffle_repartition_split_limit_materialize():
    ds = data.from_items([{"a": i} for i in range(20)], override_num_blocks=4)
    shuffled = [r["a"] for r in ds.random_shuffle(seed=1).take_all()]
    assert sorted(shuffled) == list(range(20)) and shuffled != list(range(20))
    assert ds.repartition(5).num_blocks() == 5 and ds.repartition(5).count() == 20
    train, test = ds.train_test_split(0.25)
    assert (train.count(), test.count()) == (15, 5) and test.take(1)[0]["a"] == 15
    assert [r["a"] for r in ds.limit(3).take_all()] == [0, 1, 2]
    assert ds.map(lambda r: {"a": r["a"] + 1}).materialize().ops == ()
    order = [r["a"] for r in ds.randomize_block_order(seed=3).iter_rows()]
    assert sorted(order) == list(range(20))


# -- bad input ----------------------------------------------------------------------------


def test_a_missing_path_is_named(tmp_path):
    with pytest.raises(DataReadError, match=r"read_parquet\('.*nothing'\): no such file"):
        data.read_parquet(str(tmp_path / "nothing"))


def test_a_corrupt_parquet_file_is_named_with_the_fix(tmp_path):
    _parquet(tmp_path, files=1)
    (tmp_path / "part-9.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataReadError, match=r"part-9\.parquet could not be read as parquet.*re-write it"):
        data.read_parquet(str(tmp_path))


def test_mixed_schemas_are_refused_naming_both_files(tmp_path):
    pq.write_table(pa.table({"a": [1]}), tmp_path / "one.parquet")
    pq.write_table(pa.table({"a": ["x"]}), tmp_path / "two.parquet")
    with pytest.raises(DataReadError, match=r"two\.parquet has the schema \{a: string\} but .*one\.parquet"):
        data.read_parquet(str(tmp_path))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "1.csv").write_text("a\n1\n")
    (tmp_path / "c" / "2.csv").write_text("b\nz\n")
    with pytest.raises(DataReadError, match=r"2\.csv has columns \{b: string\} but .*1\.csv"):
        data.read_csv(str(tmp_path / "c")).take_all()


def test_a_map_batches_function_that_raises_keeps_its_traceback():
    def broken(batch):
        raise KeyError("no_such_column")

    ds = data.from_items([{"a": 1}]).map_batches(broken)
    with pytest.raises(UserFunctionError, match=r"map_batches\(.*broken\) raised KeyError") as info:
        ds.take_all()
    assert isinstance(info.value.__cause__, KeyError)
    assert any(frame.name == "broken" for frame in __import__("traceback").extract_tb(info.value.__cause__.__traceback__))


def test_a_file_that_is_not_its_format_is_named(tmp_path):
    np.save(tmp_path / "ok.npy", np.arange(3))
    (tmp_path / "bad.npy").write_bytes(b"garbage")
    with pytest.raises(DataReadError, match=r"bad\.npy: could not be read as numpy.*numpy\.save"):
        data.read_numpy(str(tmp_path)).take_all()


def test_an_unsupported_method_is_refused_naming_it():
    with pytest.raises(AttributeError, match="Dataset.groupby is not supported"):
        data.from_items([1]).groupby("a")


def test_read_images_decodes_and_names_an_image_that_does_not(tmp_path):
    for i in range(3):
        pil.fromarray(np.full((4, 6, 3), i * 40, np.uint8)).save(tmp_path / f"img{i}.png")
    ds = data.read_images(str(tmp_path), include_paths=True)
    batch = next(iter(ds.iter_batches(batch_size=None)))
    assert batch["image"].shape == (3, 4, 6, 3) and int(batch["image"][2].max()) == 80
    assert data.read_images(str(tmp_path), size=(2, 3), mode="L").take(1)[0]["image"].shape == (2, 3)
    (tmp_path / "broken.jpg").write_bytes(b"not an image")
    with pytest.raises(DataReadError, match=r"broken\.jpg: could not be read as images.*Pillow can open"):
        data.read_images(str(tmp_path)).take_all()
