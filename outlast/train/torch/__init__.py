"""`outlast.train.torch`: PyTorch distributed data parallel on outlast.

Importing this module does not import torch in the driver; the workers import it
(already loaded in the fork server, so a restart does not pay for it again).
"""

from outlast.train.torch.backend import TorchBackend, TorchConfig
from outlast.train.torch.checkpoint import save_async
from outlast.train.torch.helpers import get_device, prepare_data_loader, prepare_model
from outlast.train.torch.trainer import TorchTrainer

__all__ = ["TorchBackend", "TorchConfig", "TorchTrainer", "get_device", "prepare_data_loader", "prepare_model",
           "save_async"]
