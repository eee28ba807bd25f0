"""A Lightning run in the shape of Ray's Lightning guide (tiny model, synthetic data), run unchanged by Ray 2.60
and by `outlast run`: python lightning_example.py STORAGE_DIR"""
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import ray.train.lightning
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def train_func():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g))
    trainer = pl.Trainer(max_epochs=3, devices="auto", accelerator="auto",
                         strategy=ray.train.lightning.RayDDPStrategy(),
                         plugins=[ray.train.lightning.RayLightningEnvironment()],
                         callbacks=[ray.train.lightning.RayTrainReportCallback()],
                         enable_progress_bar=False, logger=False, enable_checkpointing=False)
    trainer = ray.train.lightning.prepare_trainer(trainer)
    trainer.fit(Tiny(), train_dataloaders=DataLoader(data, batch_size=16))


result = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2),
                      run_config=RunConfig(name="lightning", storage_path=sys.argv[1])).fit()
assert result.metrics["epoch"] == 2, result.metrics
print("ok", result.metrics)
