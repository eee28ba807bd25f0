"""The Ray Train names outlast offers, in real gloo workers, with Ray's semantics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from outlast.train import (
    CheckpointConfig, RunConfig, ScalingConfig, TrainingFailedError, WorkerGroupError, DataConfig, Result,
)
from tests.integration.jobs import read_events


@pytest.mark.torch
def test_ray_names_in_one_run_duplicates_kept_once_and_the_result_as_ray_gives_it(storage_path, tmp_path):
    from outlast.train.torch import TorchConfig, TorchTrainer
    from tests.integration.ray_api_jobs import every_name_loop

    events = tmp_path / "events.jsonl"
    result = TorchTrainer(
        every_name_loop, train_loop_config={"events": str(events)},
        scaling_config=ScalingConfig(num_workers=2),
        datasets={"train": {"x": np.arange(10)}, "validation": [{"v": i} for i in range(5)]},
        dataset_config=DataConfig(datasets_to_split=["train"]),
        torch_config=TorchConfig(init_method="tcp"),
        run_config=RunConfig(name="ray_api", storage_path=storage_path, checkpoint_config=CheckpointConfig(
            num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min"),
            worker_runtime_env={"env_vars": {"RAYCOMPAT_ENV": "from runtime env"}}),
    ).fit()

    by_rank = {e["rank"]: e for e in read_events(events)}
    assert by_rank[0]["seen"] == [0, 1, 2, 3, 4] and by_rank[1]["seen"] == [5, 6, 7, 8, 9]
    assert by_rank[0]["whole"] == by_rank[1]["whole"] == 5
    assert by_rank[0]["loader"] == ["TensorDataset", 4, 2]
    assert by_rank[0]["devices"] == ["cpu"] and by_rank[0]["deterministic"] is True
    assert by_rank[0]["env"] == by_rank[1]["env"] == "from runtime env"  # and DDP met over tcp://
    # The kept checkpoints (epochs 1 and 2: the best two on loss; epoch 2 is also the latest), ordered as
    # Ray 2.60 orders them (by score, the best last), each with its metadata, under the directory name asked for.
    assert by_rank[1]["reported"] == [[2, {"epoch": 2}, "epoch_2"], [1, {"epoch": 1}, "epoch_1"]]

    # Ray V2: metrics of the latest checkpoint, best checkpoints best last, rank 0's return value.
    assert result.metrics == {"loss": 2.0, "epoch": 2}
    assert [m["epoch"] for _, m in result.best_checkpoints] == [2, 1]
    assert result.get_best_checkpoint("loss", "min").get_metadata()["epoch"] == 1
    assert list(result.metrics_dataframe["loss"]) == [2.0, 1.0]
    assert result.return_value == {"rank": 0, "seen": 5}
    assert Result.from_path(result.path).metrics == result.metrics

    # Both ranks wrote model.pt with different bytes: the run went on, keeping one whole copy,
    # and its history says so once.
    state = json.loads((tmp_path / "storage" / "ray_api" / "run_state.json").read_text())
    (note,) = state["notes"]
    assert "'model.pt' (ranks 0, 1)" in note["text"]
    import torch

    kept = torch.load(f"{result.checkpoint.path}/model.pt")
    assert "1.running_mean" in kept


@pytest.mark.torch
def test_strict_duplicate_files_refuse_the_checkpoint(storage_path, tmp_path):
    from outlast.train.torch import TorchTrainer
    from tests.integration.ray_api_jobs import every_name_loop

    with pytest.raises(TrainingFailedError, match="both wrote 'model.pt' with different contents"):
        TorchTrainer(
            every_name_loop, train_loop_config={"events": str(tmp_path / "e.jsonl")},
            scaling_config=ScalingConfig(num_workers=2),
            datasets={"train": {"x": np.arange(10)}, "validation": [{"v": 1}]},
            run_config=RunConfig(name="strict", storage_path=storage_path,
                                 checkpoint_config=CheckpointConfig(duplicate_files="fail")),
        ).fit()


@pytest.mark.torch
def test_a_failing_loop_raises_worker_group_error_with_the_ranks_failures(storage_path):
    from outlast.train.torch import TorchTrainer
    from tests.integration.ray_api_jobs import failing_loop

    with pytest.raises(WorkerGroupError) as info:
        TorchTrainer(failing_loop, scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(name="fails", storage_path=storage_path)).fit()
    # Both ranks raise at once. The first failure heard stops the other rank: one that had not raised yet when its
    # stop came did not fail of itself, and is not among the failures (as with Ray's). Every rank listed failed
    # with the loop's error, the root cause's rank among them.
    failures = info.value.worker_failures
    assert failures and set(failures) <= {0, 1}
    assert all("the loop's own error" in str(f) for f in failures.values()), failures


@pytest.mark.torch
def test_the_fsdp2_tutorials_full_model_is_opened_after_fit_where_ray_puts_it(storage_path):
    """Ray's FSDP2 tutorial reports its last save with checkpoint_dir_name="full_model" and, after fit(),
    opens {storage_path}/{name}/full_model/full-model.pt."""
    import torch

    from outlast.train.torch import TorchTrainer
    from tests.integration.ray_api_jobs import fsdp2_full_model_loop

    result = TorchTrainer(fsdp2_full_model_loop, scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="fsdp_mnist", storage_path=storage_path)).fit()
    state = torch.load(f"{storage_path}/fsdp_mnist/full_model/full-model.pt")
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    plain.load_state_dict(state)  # whole tensors, not shards
    assert result.checkpoint.path == f"{storage_path}/fsdp_mnist/full_model"
    run = json.loads((Path(storage_path) / "fsdp_mnist" / "run_state.json").read_text())
    assert [c["checkpoint_dir"] for c in run["checkpoints"]] == [
        "checkpoint_001_000000", "checkpoint_001_000001", "full_model"]


@pytest.mark.parametrize("names, said", [
    (["same", "same"], "checkpoint_dir_name='same' is taken"),
    (["first", "a/b"], "without '/'"),
    (["first", "reports"], "the run directory keeps its own 'reports'"),
])
def test_a_name_taken_or_not_a_directory_name_fails_the_report_and_keeps_what_was_committed(
        names, said, storage_path):
    from outlast.train import Trainer
    from tests.integration.ray_api_jobs import named_twice_loop

    with pytest.raises(WorkerGroupError, match=re.escape(said)):
        Trainer(named_twice_loop, train_loop_config={"names": names}, scaling_config=ScalingConfig(num_workers=2),
                run_config=RunConfig(name="named", storage_path=storage_path)).fit()
    run = json.loads((Path(storage_path) / "named" / "run_state.json").read_text())
    assert [c["checkpoint_dir"] for c in run["checkpoints"]] == [names[0]]
    assert json.loads((Path(storage_path) / "named" / names[0] / "n.json").read_text()) == {"report": 0}
