"""A live run's checkpoint in parts (`outlast/train/torch/live_checkpoint.py`): who writes which file, and the
restore's refusals of a checkpoint it cannot load whole, each before anything is loaded, saying what to do."""

from __future__ import annotations

import pytest

from outlast.train.torch import live_checkpoint as lc

torch = pytest.importorskip("torch")


def test_the_first_replica_writes_every_shard_once_and_rank_0_the_rest():
    assert lc.parts(0, 1) == ["live.json", "model.pt", "state.pt", "optimizer.pt"]
    assert lc.parts(1, 1) == []
    written = [lc.parts(rank, 3) for rank in range(6)]
    assert written[1:] == [["optimizer-shard-1-of-3.pt"], ["optimizer-shard-2-of-3.pt"], [], [], []]
    assert sorted(f for files in written for f in files if f.startswith("optimizer")) == \
        [lc.optimizer_file(s, 3) for s in range(3)]


def _never():
    raise AssertionError("a state dict was asked of a rank that writes no part holding it")


def _saved(tmp_path, shards: int):
    model = torch.nn.Linear(2, 1)
    for rank in range(2 * shards):
        optimizer = (lambda r=rank: {"shard": r}) if rank < shards else _never  # asked only where it is written
        wrote = lc.save(tmp_path, rank, 7, shards, model.state_dict if rank == 0 else _never, optimizer,
                        (lambda: {"seen": [1, 2]}) if rank == 0 else _never)
        assert wrote == (rank < shards)
    return model


@pytest.mark.parametrize("shards", [1, 2])
def test_each_rank_restores_the_weights_the_state_and_its_own_shard(tmp_path, shards):
    model = _saved(tmp_path, shards)
    for shard in range(shards):
        restored = lc.load(tmp_path, shard, shards)
        assert restored.step == 8 and restored.optimizer == {"shard": shard} and restored.state == {"seen": [1, 2]}
        assert all(torch.equal(restored.model[k], v) for k, v in model.state_dict().items())


def test_a_checkpoint_of_another_layout_is_refused_saying_which_to_restart_with(tmp_path):
    _saved(tmp_path, 2)
    with pytest.raises(ValueError, match=r"in 2 shard\(s\) and this run in 3: restart it with LiveTraining\(shards=2\)"):
        lc.load(tmp_path, 0, 3)


def test_a_missing_part_or_layout_is_named(tmp_path):
    _saved(tmp_path, 2)
    (tmp_path / "optimizer-shard-1-of-2.pt").unlink()
    assert lc.load(tmp_path, 0, 2).optimizer == {"shard": 0}
    with pytest.raises(FileNotFoundError, match="lacks optimizer-shard-1-of-2.pt"):
        lc.load(tmp_path, 1, 2)
    (tmp_path / "live.json").unlink()
    with pytest.raises(FileNotFoundError, match="not a checkpoint LiveTraining.save wrote"):
        lc.load(tmp_path, 0, 2)


@pytest.mark.parametrize("layout", [b'{"step": -1, "shards": 2}', b'{"step": 1}', b'{"step": 1, "shards": 2, "x": 0}',
                                    b"[]", b'{"step": "1", "shards": 2}', b"{"])
def test_a_damaged_layout_is_refused(tmp_path, layout):
    _saved(tmp_path, 2)
    (tmp_path / "live.json").write_bytes(layout)
    with pytest.raises(ValueError, match="is not a live checkpoint's layout"):
        lc.load(tmp_path, 0, 2)


class _Anything:
    pass


def test_a_part_holding_objects_is_not_constructed(tmp_path):
    _saved(tmp_path, 1)
    torch.save(_Anything(), tmp_path / "state.pt")
    with pytest.raises(ValueError, match=r"state.pt could not be read as tensors and plain data"):
        lc.load(tmp_path, 0, 1)


def test_the_step_saved_is_a_committed_one(tmp_path):
    with pytest.raises(ValueError, match="the committed one, 0 or more"):
        lc.save(tmp_path, 0, -1, 1, dict, dict, lambda: None)


def test_a_sharded_model_s_weights_are_written_by_the_first_replica_one_shard_each(tmp_path):
    written = [lc.parts(rank, 2, model_sharded=True) for rank in range(4)]
    assert written == [["live.json", "state.pt", "optimizer-shard-0-of-2.pt", "model-shard-0-of-2.pt"],
                       ["optimizer-shard-1-of-2.pt", "model-shard-1-of-2.pt"], [], []]
    for rank in range(4):
        lc.save(tmp_path, rank, 3, 2, (lambda r=rank: {"w": torch.full((2,), float(r))}) if rank < 2 else _never,
                (lambda r=rank: {"shard": r}) if rank < 2 else _never,
                (lambda: {"seen": 1}) if rank == 0 else _never, model_sharded=True)
    for shard in range(2):
        restored = lc.load(tmp_path, shard, 2, model_sharded=True)
        assert restored.step == 4 and torch.equal(restored.model["w"], torch.full((2,), float(shard)))
        assert restored.optimizer == {"shard": shard} and restored.state == {"seen": 1}


@pytest.mark.parametrize("saved_sharded", [True, False])
def test_a_checkpoint_whose_model_is_kept_otherwise_is_refused(tmp_path, saved_sharded):
    for rank in range(2):
        lc.save(tmp_path, rank, 3, 2, lambda: {"w": torch.zeros(1)}, lambda: {}, lambda: None,
                model_sharded=saved_sharded)
    with pytest.raises(ValueError, match="load it with LiveTraining\\(mesh=live_mesh\\(...\\)\\) if and only if"):
        lc.load(tmp_path, 0, 2, model_sharded=not saved_sharded)
