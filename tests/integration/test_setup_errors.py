"""A worker that cannot be set up the same way every time fails the run at once with its error, spending no
retry: an import error in the train function's module, and use_gpu=True on a node that sees no CUDA device."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer, TrainingFailedError

MODULE = '''
import os
if "OUTLAST_ATTEMPT" in os.environ:  # on the workers only: a package the nodes lack
    import outlast_package_missing_on_the_nodes  # noqa: F401


def train_fn(config):
    pass
'''


def killed_at_once(config):
    from outlast.train import get_context

    if get_context().get_world_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # before any call that would carry a message after the set-up's
    time.sleep(60)


def _state(storage_path) -> dict:
    return json.loads((Path(storage_path) / "run" / "run_state.json").read_text())


def test_an_import_error_in_the_train_functions_module_fails_at_once_without_spending_retries(
        storage_path, tmp_path, monkeypatch):
    (tmp_path / "mod_missing_on_nodes.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import mod_missing_on_nodes

    try:
        with pytest.raises(TrainingFailedError) as info:
            Trainer(mod_missing_on_nodes.train_fn, scaling_config=ScalingConfig(num_workers=2),
                    run_config=RunConfig(name="run", storage_path=storage_path,
                                         failure_config=FailureConfig(max_failures=5))).fit()
    finally:
        sys.modules.pop("mod_missing_on_nodes", None)
    text = str(info.value)
    assert "ModuleNotFoundError" in text and "outlast_package_missing_on_the_nodes" in text
    assert "every retry would fail the same way" in text
    state = _state(storage_path)
    assert len(state["attempts"]) == 1 and state["status"] == "errored"


@pytest.mark.torch
def test_use_gpu_on_a_node_without_cuda_fails_at_once_naming_the_node(storage_path):
    import torch

    from outlast.train.torch import TorchTrainer

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the error cannot happen here")
    with LocalCluster(num_nodes=1) as cluster:
        cluster.add_node("gpu-node", extra_args=["--num-gpus", "1"])
        with pytest.raises(TrainingFailedError) as info:
            TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1, use_gpu=True),
                         run_config=RunConfig(name="run", storage_path=storage_path,
                                              failure_config=FailureConfig(max_failures=-1))).fit()  # -1: forever
    assert "WorkerSetupError" in str(info.value) and "gpu-node sees no CUDA device" in str(info.value)
    assert len(_state(storage_path)["attempts"]) == 1


@pytest.mark.torch
def test_a_rank_killed_in_the_rendezvous_is_retried_on_the_setup_budget_and_not_charged(
        storage_path, tmp_path, monkeypatch):
    from outlast.train.torch import TorchTrainer
    from tests.integration.jobs import ddp_loop

    # Rank 1 is SIGKILLed as it sets out to meet rank 0, in the first attempt only; rank 0, left waiting in the
    # store for a rank that never comes, is ended by the teardown. Nothing of the user's has run.
    monkeypatch.setenv("OUTLAST_FAULT_POINTS", "rendezvous.rank1=kill")
    result = TorchTrainer(ddp_loop, train_loop_config={"steps": 4, "events": str(tmp_path / "events.jsonl")},
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="run", storage_path=storage_path,
                                               failure_config=FailureConfig(max_failures=0))).fit()

    assert result.metrics is None and result.last_metrics["step"] == 3
    state = _state(storage_path)
    assert state["status"] == "finished" and len(state["attempts"]) == 2
    assert state["failure_counts"] == {"setup": 1}  # max_failures=0 and nothing charged to it
    first = state["attempts"][0]
    assert first["outcome"] == "failed" and first["failures"][0]["rank"] == 1 and first["failures"][0]["signal"] == 9
    (note,) = [n["text"] for n in state["notes"] if "set-up" in n["text"]]
    assert note.startswith("attempt 1: rank 1") and "set-up failure 1 of 3, not counted against max_failures" in note


def test_a_rank_killed_as_its_train_function_starts_is_charged_to_max_failures_not_to_the_set_up(storage_path):
    # The rank's SetUp is the last message it sends; it dies the instant after. Unless the controller had heard
    # it before the train function ran, the death would be taken for outlast's set-up's and retried for free.
    with pytest.raises(TrainingFailedError):
        Trainer(killed_at_once, scaling_config=ScalingConfig(num_workers=2),
                run_config=RunConfig(name="run", storage_path=storage_path,
                                     failure_config=FailureConfig(max_failures=0))).fit()
    state = _state(storage_path)
    assert len(state["attempts"]) == 1 and state["status"] == "errored"
    assert "setup" not in state["failure_counts"]
    assert state["attempts"][0]["failures"][0]["rank"] == 1 and state["attempts"][0]["failures"][0]["signal"] == 9
