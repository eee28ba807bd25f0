from __future__ import annotations

from outlast.train.config import ScalingConfig
from outlast.train.framework_trainer import FrameworkTrainer
from outlast.train.torch.backend import TorchBackend, TorchConfig


class TorchTrainer(FrameworkTrainer):
    """Sets up `torch.distributed` in every worker (gloo on CPU, NCCL with `use_gpu`). `torch_config`: a
    `TorchConfig`; `isolation`: outlast's, as `DataParallelTrainer` takes it."""

    config_arg = "torch_config"
    own_args = ("isolation",)

    def make_backend(self, config: TorchConfig | None, scaling_config: ScalingConfig) -> TorchBackend:
        return TorchBackend(config, use_gpu=scaling_config.use_gpu)
