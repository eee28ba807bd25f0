"""A worker that cannot be set up the same way every time fails the run at once with its error, spending no
retry: an import error in the train function's module, and use_gpu=True on a node that sees no CUDA device."""

from __future__ import annotations

import json
import sys
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
