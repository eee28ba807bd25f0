"""`outlast.train.torch`: PyTorch distributed data parallel on outlast.

Importing this module does not import torch in the driver; the workers import it
(already loaded in the fork server, so a restart does not pay for it again).
"""

from outlast.train import unsupported as _unsupported
from outlast.train.torch.backend import TorchBackend, TorchConfig
from outlast.train.torch.checkpoint import save_async
from outlast.train.torch.helpers import (
    accelerate, backward, enable_reproducibility, get_device, get_devices, prepare_data_loader, prepare_model,
    prepare_optimizer,
)
from outlast.train.torch.live import LiveTraining, live_mesh
from outlast.train.torch.trainer import TorchTrainer
from outlast.train.torch.virtual_ranks import virtual_rank_gradients

__all__ = [
    "LiveTraining", "TorchBackend", "live_mesh", "TorchConfig", "TorchTrainer", "accelerate", "backward", "enable_reproducibility", "get_device",
    "get_devices", "prepare_data_loader", "prepare_model", "prepare_optimizer", "save_async",
    "virtual_rank_gradients",
]


def __getattr__(name: str):
    # Ray Train names outlast does not offer fail with what to do instead (an ImportError, which
    # `from ... import` passes on as it is); any other name is an ordinary missing attribute.
    raise _unsupported.refuse(__name__, _unsupported.TORCH, name)
