"""`outlast.train.lightning`: PyTorch Lightning inside a `TorchTrainer`, with Ray Train's names.

The same classes as `ray.train.lightning` and the same behaviour: the strategies take their
device and ranks from the run, `RayTrainReportCallback` saves `checkpoint.ckpt` at the end of
each training epoch and reports it with `trainer.callback_metrics`, and `prepare_trainer` checks
that the strategy and environment are these. Built on `lightning.pytorch` when installed, else on
`pytorch_lightning`, as Ray's is.

outlast adds `PreemptionCheckpointCallback`: on a drain notice (`get_preemption_info()`), every
rank saves one checkpoint on the same batch and reports it, so the run moves without losing a
step. A run resumes from `get_checkpoint()` as on Ray (`trainer.fit(model, ckpt_path=...)`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.environments import LightningEnvironment
except ModuleNotFoundError:
    try:
        import pytorch_lightning as pl
        from pytorch_lightning.plugins.environments import LightningEnvironment
    except ModuleNotFoundError:
        raise ModuleNotFoundError("outlast.train.lightning needs PyTorch Lightning: pip install lightning "
                                  "(or pytorch_lightning)") from None

import torch

from outlast import train
from outlast.train.checkpoint import Checkpoint, CheckpointUploadMode
from outlast.train.torch.helpers import get_device

__all__ = [
    "PreemptionCheckpointCallback", "RayDDPStrategy", "RayDeepSpeedStrategy", "RayFSDPStrategy",
    "RayLightningEnvironment", "RayTrainReportCallback", "prepare_trainer",
]


class _RunPlacement:
    """The device and the sampler's ranks come from the run, not from Lightning's own launcher."""

    @property
    def root_device(self) -> torch.device:
        return get_device()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return dict(num_replicas=self.world_size, rank=self.global_rank)


class RayDDPStrategy(_RunPlacement, pl.strategies.DDPStrategy):
    """Lightning's DDPStrategy on the process group `TorchTrainer` set up (TorchConfig's backend and timeout)."""


class RayFSDPStrategy(_RunPlacement, pl.strategies.FSDPStrategy):
    """Lightning's FSDPStrategy on the run's process group (Lightning >= 2.1 saves FSDP state itself)."""


class RayDeepSpeedStrategy(_RunPlacement, pl.strategies.DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy on the run's process group; needs `deepspeed` installed."""


class RayLightningEnvironment(LightningEnvironment):
    """World size and ranks from `outlast.train.get_context()`."""

    def world_size(self) -> int:
        return train.get_context().get_world_size()

    def global_rank(self) -> int:
        return train.get_context().get_world_rank()

    def local_rank(self) -> int:
        return train.get_context().get_local_rank()

    def node_rank(self) -> int:
        return train.get_context().get_node_rank()

    def set_world_size(self, size: int) -> None:
        pass  # the run's context says it

    def set_global_rank(self, rank: int) -> None:
        pass

    def teardown(self) -> None:
        pass


_STRATEGIES = (RayDDPStrategy, RayFSDPStrategy, RayDeepSpeedStrategy)


def prepare_trainer(trainer: pl.Trainer) -> pl.Trainer:
    """Check that `trainer` runs on one of the strategies above with `RayLightningEnvironment`."""
    if not isinstance(trainer.strategy, _STRATEGIES):
        raise RuntimeError(f"Invalid strategy class: {type(trainer.strategy)}. To use PyTorch Lightning with "
                           f"outlast, the strategy must be one of {[c.__name__ for c in _STRATEGIES]} or a subclass: "
                           "pl.Trainer(strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()])")
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if environment is not None and not isinstance(environment, RayLightningEnvironment):
        raise RuntimeError(f"Invalid cluster environment plugin {type(environment)}: pass "
                           "pl.Trainer(plugins=[RayLightningEnvironment()])")
    return trainer


def _scratch(kind: str) -> str:
    ctx = train.get_context()
    return Path(tempfile.gettempdir(), f"lightning_{kind}-name={ctx.get_experiment_name()}-"
                                       f"attempt={ctx.get_attempt()}-world_rank={ctx.get_world_rank()}").as_posix()


def _save_and_report(trainer: pl.Trainer, directory: str, name: str, metrics: dict[str, Any],
                     mode: CheckpointUploadMode) -> None:
    os.makedirs(directory, exist_ok=True)
    trainer.save_checkpoint(Path(directory, name).as_posix(), weights_only=False)
    train.report(metrics=metrics, checkpoint=Checkpoint.from_directory(directory), checkpoint_upload_mode=mode)
    trainer.strategy.barrier()
    if mode is CheckpointUploadMode.SYNC:  # an ASYNC upload deletes the directory once it is done
        shutil.rmtree(directory, ignore_errors=True)


class RayTrainReportCallback(pl.callbacks.Callback):
    """At the end of each training epoch: `trainer.callback_metrics` (with `epoch` and `step`) and a
    checkpoint holding `checkpoint.ckpt`, reported from every rank (Lightning writes it on rank 0)."""

    CHECKPOINT_NAME = "checkpoint.ckpt"

    def __init__(self, checkpoint_upload_mode: CheckpointUploadMode | None = None, validation: Any = False) -> None:
        super().__init__()
        if validation:
            raise ValueError("RayTrainReportCallback(validation=...) is not supported: validate in the train "
                             "function (Lightning's validation loop) and its metrics are reported with the checkpoint")
        self.checkpoint_upload_mode = CheckpointUploadMode(checkpoint_upload_mode or CheckpointUploadMode.SYNC)
        self.validation = validation
        self.tmpdir_prefix = _scratch("checkpoints")
        shutil.rmtree(self.tmpdir_prefix, ignore_errors=True)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
        metrics["epoch"] = trainer.current_epoch
        metrics["step"] = trainer.global_step
        _save_and_report(trainer, Path(self.tmpdir_prefix, str(trainer.current_epoch)).as_posix(),
                         self.CHECKPOINT_NAME, metrics, self.checkpoint_upload_mode)


class PreemptionCheckpointCallback(pl.callbacks.Callback):
    """outlast's own: on a drain notice, one checkpoint (`checkpoint.ckpt`, mid-epoch) on the same batch of
    every rank, reported with `trainer.callback_metrics`, `epoch` and `step`. Training goes on until the
    run is moved; the next attempt resumes from it (`trainer.fit(model, ckpt_path=...)`) at the same step.

    `get_preemption_info()` costs well under a microsecond while nothing is pending, so asking on every
    batch costs nothing; every rank gets the notice on the same call, so they save on the same batch.
    `on_preemption` runs on that call, before the save: override it to log or flush what the save needs
    (asking `get_preemption_info()` again there may land on either side of that call)."""

    CHECKPOINT_NAME = RayTrainReportCallback.CHECKPOINT_NAME

    def __init__(self, checkpoint_upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC) -> None:
        super().__init__()
        self.checkpoint_upload_mode = CheckpointUploadMode(checkpoint_upload_mode)
        self.saved_for: object = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        info = train.get_preemption_info()
        if info is None or info == self.saved_for:
            return
        self.saved_for = info
        self.on_preemption(trainer, info)
        metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
        metrics.update(epoch=trainer.current_epoch, step=trainer.global_step, preempted=True)
        _save_and_report(trainer, _scratch(f"preemption-{trainer.global_step}"), self.CHECKPOINT_NAME, metrics,
                         self.checkpoint_upload_mode)

    def on_preemption(self, trainer: pl.Trainer, info: Any) -> None:
        """Called once per notice, on the batch whose checkpoint it makes, before that checkpoint is saved."""
