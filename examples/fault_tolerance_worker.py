"""Worker fault tolerance: a DDP run that loses a worker and carries on from its last checkpoint.

Ports the "Worker Process and Node Fault Tolerance" section of Ray Train's
"Handling Failures and Node Preemption" user guide to outlast.

Two CPU workers train a small regression model with DistributedDataParallel. Rank 0
saves a checkpoint (model, optimizer, epoch) at the end of every epoch. On the first
attempt one rank raises an exception part-way through; because the run has
`FailureConfig(max_failures=3)`, outlast stops both workers, starts a fresh pair, and
`get_checkpoint()` hands them the latest committed checkpoint, so training resumes at
the epoch after it instead of starting over.

    python examples/fault_tolerance_worker.py [--storage_path DIR] [--run_name NAME]

Without `--storage_path` the run writes to a new temporary directory.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import uuid

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import outlast.train
import outlast.train.torch
from outlast.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from outlast.train.torch import TorchTrainer

STATE_FILE = "state.pt"


def make_dataset(num_samples: int = 256) -> TensorDataset:
    # The same data on every rank and every attempt: y = 3*x0 - 2*x1 + 0.5*x2 + noise.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 3, generator=g)
    y = x @ torch.tensor([[3.0], [-2.0], [0.5]]) + 0.05 * torch.randn(num_samples, 1, generator=g)
    return TensorDataset(x, y)


def train_fn_per_worker(config: dict) -> None:
    rank = outlast.train.get_context().get_world_rank()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    # [1] Restore: a restarted attempt gets the latest committed checkpoint here.
    start_epoch = 0
    checkpoint = outlast.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as checkpoint_dir:
            state = torch.load(os.path.join(checkpoint_dir, STATE_FILE))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
        print(f"[rank {rank}] restored the checkpoint of epoch {state['epoch']}; resuming at epoch {start_epoch}",
              flush=True)

    model = outlast.train.torch.prepare_model(model)
    loader = outlast.train.torch.prepare_data_loader(
        DataLoader(make_dataset(), batch_size=32, shuffle=True)
    )
    loss_fn = nn.MSELoss()

    for epoch in range(start_epoch, config["num_epochs"]):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for x, y in loader:
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1

        # Inject one failure: only an attempt that started from scratch crashes, so the
        # restarted attempt (which restores a checkpoint) runs to the end.
        if checkpoint is None and epoch == config["crash_epoch"] and rank == config["crash_rank"]:
            raise RuntimeError(f"injected failure on rank {rank} at epoch {epoch}")

        metrics = {"epoch": epoch, "loss": total / max(batches, 1), "start_epoch": start_epoch}
        # [2] Save: rank 0 holds a full replica, so it alone writes the files; every
        # rank calls report() so that they all reach the same report together.
        with tempfile.TemporaryDirectory() as tmp:
            to_report = None
            if rank == 0:
                torch.save(
                    {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                    os.path.join(tmp, STATE_FILE),
                )
                to_report = Checkpoint.from_directory(tmp)
            outlast.train.report(metrics, checkpoint=to_report)
        if rank == 0:
            print(f"[rank 0] epoch {epoch} loss {metrics['loss']:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage_path", default=None, help="where checkpoints go (default: a new temp dir)")
    parser.add_argument("--run_name", default=None, help="the run's name (default: a unique one)")
    parser.add_argument("--num_epochs", type=int, default=6)
    parser.add_argument("--crash_epoch", type=int, default=3)
    parser.add_argument("--crash_rank", type=int, default=1)
    parser.add_argument("--max_failures", type=int, default=3)
    args = parser.parse_args()

    storage_path = args.storage_path or tempfile.mkdtemp(prefix="outlast_ft_worker_")
    run_name = args.run_name or f"ft_worker-{uuid.uuid4().hex[:8]}"

    trainer = TorchTrainer(
        train_fn_per_worker,
        train_loop_config={
            "num_epochs": args.num_epochs, "crash_epoch": args.crash_epoch, "crash_rank": args.crash_rank,
        },
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=run_name,
            storage_path=storage_path,
            # [3] Restart the workers up to 3 times before giving up.
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    result = trainer.fit()

    print(f"run directory: {result.path}")
    print(f"final metrics: {result.metrics}")
    print(f"final checkpoint: {result.checkpoint}")
    if result.metrics and result.metrics["start_epoch"] > 0:
        print(f"recovered: the last attempt resumed at epoch {result.metrics['start_epoch']}")
    print(f"finished at epoch {result.metrics['epoch'] if result.metrics else None}")


if __name__ == "__main__":
    main()
