"""Ray Train V2's API or outlast's under the same names, and the model and the run of the scenarios
that run unchanged on either (core_scenario, durable_scenario).

The workers import this module too: nothing but the standard library at import time.
"""

from __future__ import annotations

import importlib
import os
import time
import types

from bench.lib.events import emit

# What a scenario takes from `ray.train` or `outlast.train`; both spell them alike.
TRAIN_NAMES = ("Checkpoint", "CheckpointConfig", "CheckpointUploadMode", "FailureConfig", "RunConfig",
               "ScalingConfig")


def load_api(framework: str) -> types.SimpleNamespace:
    """The whole framework switch: `train`, the names of TRAIN_NAMES, TorchTrainer and prepare_model."""
    if framework not in ("ray", "outlast"):
        raise ValueError(f"unknown framework {framework!r}: 'ray' or 'outlast'")
    train = importlib.import_module(f"{framework}.train")
    torch_side = importlib.import_module(f"{framework}.train.torch")
    return types.SimpleNamespace(train=train, TorchTrainer=torch_side.TorchTrainer,
                                 prepare_model=torch_side.prepare_model,
                                 **{name: getattr(train, name) for name in TRAIN_NAMES})


def restored_mlp(api: types.SimpleNamespace):
    """The scenarios' MLP, ready for DDP, and its SGD optimizer, both restored from the run's checkpoint
    (`state.pt`) when it has one: (model, optimizer, first step to train, step restored from or None)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt_state, start, restored_from = None, 1, None
    ckpt = api.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        opt_state, restored_from = state["optim"], state["step"]
        start = restored_from + 1
    model = api.prepare_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    return model, opt, start, restored_from


def fit(api: types.SimpleNamespace, loop, config: dict, *, events: str, workers: int, name: str,
        storage: str) -> bool:
    """Trains `loop` on `workers` CPU ranks as both scenarios do (3 failures allowed, the last 2
    checkpoints kept), with fit()'s start and end in `events`: whether the run ended without an error."""
    trainer = api.TorchTrainer(
        loop, train_loop_config=config,
        scaling_config=api.ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=api.RunConfig(name=name, storage_path=storage, failure_config=api.FailureConfig(max_failures=3),
                                 checkpoint_config=api.CheckpointConfig(num_to_keep=2)))
    emit(events, ev="fit_start", t=time.time())
    ok = False
    try:
        ok = trainer.fit().error is None
    finally:
        emit(events, ev="fit_end", t=time.time(), ok=ok)
    return ok
