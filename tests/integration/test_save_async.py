"""`outlast.train.torch.save_async` in real workers: the loop goes on while the state it
staged is written and uploaded, and what commits is the state of the step it was saved at."""

from __future__ import annotations

import pytest

from outlast.storage import open_storage
from outlast.storage.run_store import RunStore
from outlast.train import FailureConfig, RunConfig, ScalingConfig
from tests.integration.jobs import read_events, save_async_loop


def _fit(storage_path, events, **config):
    from outlast.train.torch import TorchTrainer

    return TorchTrainer(save_async_loop, train_loop_config={"events": str(events), "steps": 12, "every": 5, **config},
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name="staged", storage_path=storage_path,
                                             failure_config=FailureConfig(max_failures=1))).fit()


@pytest.mark.torch
def test_a_staged_save_commits_the_state_of_its_step_and_a_restart_restores_it(storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    result = _fit(storage_path, events, fault={"rank": 1, "step": 7, "when": "before_report", "kind": "kill"},
                  committed_before=7, run_dir=f"{storage_path}/staged")
    assert result.last_metrics == {"step": 11} and result.metrics == {"step": 9}  # metrics: the latest checkpoint's
    starts = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2]
    assert {(e["restored_step"], e["restored_weights"]) for e in starts} == {(4, 4.0)}
    state = RunStore(open_storage(storage_path), "staged").load_state()
    assert state.status == "finished" and len(state.checkpoints) == 2
    import torch

    with result.checkpoint.as_directory() as d:
        saved = torch.load(f"{d}/model.pt")
    assert saved["step"] == 9 and float(saved["weights"][0]) == 9.0


@pytest.mark.torch
def test_save_async_refuses_a_file_name_outside_the_checkpoint(storage_path, tmp_path):
    import torch

    from outlast.train import TrainingFailedError
    from outlast.train.torch import TorchTrainer, save_async

    def loop(config):
        save_async({"x": torch.ones(1)}, {}, filename="../escape.pt")

    with pytest.raises(TrainingFailedError, match=r"give a relative file name such as 'model.pt'"):
        TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=1),
                     run_config=RunConfig(name="bad", storage_path=storage_path)).fit()
