"""Two real ranks write `model.pt` with different bytes, in a set order: the committed checkpoint
holds rank 0's copy whichever rank uploaded last, and the run's history says so; with
duplicate_files="fail" the checkpoint is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import xxhash

from outlast.storage import open_storage
from outlast.storage.run_store import RunStore
from outlast.train import CheckpointConfig, RunConfig, ScalingConfig, Trainer, TrainingFailedError
from tests.integration.rank_zero_jobs import every_rank_saves_model_pt, model_bytes


def _fit(storage_path: str, last: int, policy: str | None = None):
    checkpoint_config = CheckpointConfig() if policy is None else CheckpointConfig(duplicate_files=policy)
    return Trainer(every_rank_saves_model_pt, train_loop_config={"storage": storage_path, "name": "run", "last": last},
                   scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name="run", storage_path=storage_path,
                                        checkpoint_config=checkpoint_config)).fit()


def _check_rank_zero_kept(storage_path: str, last: int) -> None:
    result = _fit(storage_path, last)
    store = RunStore(open_storage(storage_path), "run")
    state = store.load_state()
    manifest = store.read_manifest(state.latest_checkpoint)
    assert store.storage.read_bytes(f"run/{state.latest_checkpoint}/model.pt") == model_bytes(0)
    (entry,) = [e for e in manifest.files if e.path == "model.pt"]
    assert entry.checksum == ("xxh3_128", xxhash.xxh3_128(model_bytes(0)).hexdigest())
    with result.checkpoint.as_directory() as d:  # a restore checks the files against the manifest
        assert (Path(d) / "model.pt").read_bytes() == model_bytes(0)
    (note,) = state.notes
    assert "'model.pt' (ranks 0, 1)" in note.text and "keeps rank 0's copy" in note.text
    assert {e.path for e in manifest.files} == {"model.pt", "rank0.txt", "rank1.txt"}


@pytest.mark.parametrize("last", [1, 0], ids=["rank1-uploads-last", "rank0-uploads-last"])
def test_the_committed_checkpoint_holds_rank_zeros_model_whichever_rank_uploads_last(storage_path, last):
    _check_rank_zero_kept(storage_path, last)


def test_on_s3_rank_one_uploading_last_still_leaves_rank_zeros_model(s3):  # noqa: F811
    _check_rank_zero_kept("s3://runs/rankzero", last=1)


def test_strict_duplicate_files_refuse_the_checkpoint_and_nothing_is_committed(storage_path):
    with pytest.raises(TrainingFailedError, match="both wrote 'model.pt' with different contents"):
        _fit(storage_path, last=1, policy="fail")
    assert RunStore(open_storage(storage_path), "run").load_state().latest_checkpoint is None
