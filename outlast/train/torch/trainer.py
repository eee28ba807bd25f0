from __future__ import annotations

from typing import Any, Callable

from outlast.train.config import RunConfig, ScalingConfig
from outlast.train.data import DataConfig
from outlast.train.torch.backend import TorchBackend, TorchConfig
from outlast.train.trainer import DataParallelTrainer


class TorchTrainer(DataParallelTrainer):
    """Sets up `torch.distributed` in every worker (gloo on CPU, NCCL with `use_gpu`)."""

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict | None = None,
        torch_config: TorchConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: DataConfig | None = None,
        validation_config: Any = None,
        metadata: dict[str, Any] | None = None,
        resume_from_checkpoint: Any = None,
        isolation=None,
    ) -> None:
        scaling_config = scaling_config or ScalingConfig()
        super().__init__(
            train_loop_per_worker, train_loop_config=train_loop_config, scaling_config=scaling_config,
            run_config=run_config, backend=TorchBackend(torch_config, use_gpu=scaling_config.use_gpu),
            isolation=isolation, datasets=datasets, dataset_config=dataset_config,
            validation_config=validation_config, metadata=metadata, resume_from_checkpoint=resume_from_checkpoint,
        )
