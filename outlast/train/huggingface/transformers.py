"""`outlast.train.huggingface.transformers`: a `transformers.Trainer` inside a `TorchTrainer`.

The same names as `ray.train.huggingface.transformers` and the same behaviour:
`RayTrainReportCallback.on_save` copies the checkpoint just saved in `args.output_dir` into
`checkpoint/` of a new directory and reports it with every metric of `state.log_history`;
`prepare_trainer` lets the trainer take a `get_dataset_shard(...).iter_torch_batches(...)`
(already batched) as its train or eval dataset.

A run resumes as on Ray: `trainer.train(resume_from_checkpoint=<get_checkpoint()>/checkpoint)`.
On a drain notice (`get_preemption_info()`), `PreemptionCheckpointCallback` (outlast's own) asks
the Trainer to save at once, so `RayTrainReportCallback` reports that checkpoint and the run
moves without losing a step.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

try:
    import transformers.trainer
    from transformers.trainer_callback import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:
    raise ModuleNotFoundError(f"outlast.train.huggingface.transformers needs transformers: pip install "
                              f"transformers ({e})") from None

import torch.distributed
from torch.utils.data import DataLoader, Dataset, IterableDataset

from outlast import train
from outlast.train.checkpoint import Checkpoint

__all__ = ["PreemptionCheckpointCallback", "RayTrainReportCallback", "prepare_trainer"]


class RayTrainReportCallback(TrainerCallback):
    """After each save: the checkpoint just saved, under `checkpoint/`, with the metrics logged so far."""

    CHECKPOINT_NAME = "checkpoint"

    def on_save(self, args, state, control, **kwargs):
        # The Trainer returns from its save on each rank without waiting for the others, and rank 0 writes
        # the shared files (the model, trainer_state.json) last: a rank that copied at once would copy them
        # half-written, or see a temporary file vanish mid-copy. Every rank saves on the same step.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        with TemporaryDirectory() as tmpdir:
            metrics: dict[str, Any] = {}
            for log in state.log_history:
                metrics.update(log)
            source = _saved_now(args.output_dir, state.global_step)
            checkpoint = None
            if source is not None:
                shutil.copytree(source, Path(tmpdir, self.CHECKPOINT_NAME))
                checkpoint = Checkpoint.from_directory(tmpdir)
            train.report(metrics=metrics, checkpoint=checkpoint)


def _saved_now(output_dir: str, step: int) -> str | None:
    """The folder the Trainer saved this step's checkpoint in. Not merely the newest of `output_dir`: a run
    resumed from an earlier step finds there the newer folders its killed predecessor saved and never
    reported, and would report one of those under this step's metrics."""
    folder = Path(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
    return str(folder) if folder.is_dir() else transformers.trainer.get_last_checkpoint(output_dir)


class PreemptionCheckpointCallback(TrainerCallback):
    """outlast's own: on a drain notice, the Trainer saves at the end of this step (every rank gets the
    notice on the same call, so all save the same step), and `RayTrainReportCallback` reports it.
    `on_preemption` runs on that call: override it to log or flush what the save needs."""

    def __init__(self) -> None:
        self.saved_for: object = None

    def on_step_end(self, args, state, control, **kwargs):
        info = train.get_preemption_info()
        if info is not None and info != self.saved_for:
            self.saved_for = info
            self.on_preemption(state, info)
            control.should_save = True
        return control

    def on_preemption(self, state, info) -> None:
        """Called once per notice, on the step whose checkpoint it makes, before the Trainer saves it."""


class _Batches(IterableDataset):
    """Batches already made (iter_torch_batches) as a dataset the Trainer's DataLoader passes on as they are."""

    def __init__(self, batches: Iterable) -> None:
        super().__init__()
        self.batches = batches

    def __iter__(self) -> Iterator:
        return iter(self.batches)


def _is_batches(dataset: Any) -> bool:
    from outlast.train.data import BatchIterable

    return isinstance(dataset, (Iterator, BatchIterable))


def _loader(batches: Iterable) -> DataLoader:
    return DataLoader(_Batches(batches), batch_size=1, collate_fn=lambda x: x[0])


def prepare_trainer(trainer: transformers.trainer.Trainer) -> transformers.trainer.Trainer:
    """Let `trainer` take iterators of batches (`get_dataset_shard(name).iter_torch_batches(...)`) as datasets."""
    base = trainer.__class__

    class RayTransformersTrainer(base):
        def get_train_dataloader(self) -> DataLoader:
            if _is_batches(self.train_dataset):
                return _loader(self.train_dataset)
            return super().get_train_dataloader()

        def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
            if eval_dataset is None:
                eval_dataset = self.eval_dataset
            if isinstance(eval_dataset, str) and isinstance(self.eval_dataset, dict) \
                    and _is_batches(self.eval_dataset[eval_dataset]):
                return _loader(self.eval_dataset[eval_dataset])
            if _is_batches(eval_dataset):
                return _loader(eval_dataset)
            return super().get_eval_dataloader(eval_dataset)

    trainer.__class__ = RayTransformersTrainer
    return trainer
