"""Saving and restoring training state with checkpoints, keeping only the newest two.

Ports the "Saving checkpoints", "Configure checkpointing" and "Restore training state
from a checkpoint" parts of Ray Train's "Saving and Loading Checkpoints" user guide to
outlast.

The train function writes everything it needs to resume (model weights, optimizer
state and the epoch number, in three files) from rank 0 only, and passes it to
`report(..., checkpoint=...)`. At its start it calls `get_checkpoint()` and, if there
is one, loads those files and continues at the next epoch. To show the restore path,
rank 0 fails on purpose on the first attempt, right after the checkpoint of
`--fail_after_epoch` is committed; the second attempt picks up from that checkpoint. With
`CheckpointConfig(num_to_keep=2)` only the two newest checkpoints stay on storage.

    python examples/checkpoint_save_restore.py [--storage_path DIR] [--run_name NAME]

Without `--storage_path` the run writes to a new temporary directory.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import uuid

import torch
from torch import nn

import outlast.train
import outlast.train.torch
from outlast.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from outlast.train.torch import TorchTrainer

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
EXTRA_STATE_FILE = "extra_state.pt"


def train_fn(config: dict) -> None:
    rank = outlast.train.get_context().get_world_rank()

    # A toy problem: 4 features -> 1 target, the same on every rank.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)

    torch.manual_seed(0)
    model = outlast.train.torch.prepare_model(nn.Linear(4, 1))  # DDP across the workers
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    loss_fn = nn.MSELoss()

    # ---- restore: load all the state a checkpoint holds, then continue after it ----
    start_epoch = 0
    checkpoint = outlast.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as checkpoint_dir:
            model.module.load_state_dict(torch.load(os.path.join(checkpoint_dir, MODEL_FILE)))
            optimizer.load_state_dict(torch.load(os.path.join(checkpoint_dir, OPTIMIZER_FILE)))
            start_epoch = torch.load(os.path.join(checkpoint_dir, EXTRA_STATE_FILE))["epoch"] + 1
        if rank == 0:
            print(f"restored from checkpoint: continuing at epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, config["num_epochs"]):
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        metrics = {"epoch": epoch, "loss": loss.item(), "start_epoch": start_epoch}

        # ---- save: rank 0 writes the files; every rank calls report() ----
        with tempfile.TemporaryDirectory() as tmp:
            to_report = None
            if rank == 0 and epoch % config["checkpoint_freq"] == 0:
                torch.save(model.module.state_dict(), os.path.join(tmp, MODEL_FILE))  # unwrapped from DDP
                torch.save(optimizer.state_dict(), os.path.join(tmp, OPTIMIZER_FILE))
                torch.save({"epoch": epoch}, os.path.join(tmp, EXTRA_STATE_FILE))
                to_report = Checkpoint.from_directory(tmp)
            outlast.train.report(metrics, checkpoint=to_report)
        if rank == 0:
            print(f"epoch {epoch}: loss {metrics['loss']:.4f}", flush=True)

        # Fail once, on the attempt that started from scratch, to exercise the restore above.
        # Rank 0 is the one to fail: its report() returned only once the checkpoint was
        # committed, so the restore is sure to find it. The other ranks' report() returns
        # at once, and a failure they raised here could come before the commit.
        if checkpoint is None and epoch == config["fail_after_epoch"] and rank == 0:
            raise RuntimeError(f"intentional failure after epoch {epoch}, to show the restore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage_path", default=None, help="where checkpoints go (default: a new temp dir)")
    parser.add_argument("--run_name", default=None, help="the run's name (default: a unique one)")
    parser.add_argument("--num_epochs", type=int, default=5)
    parser.add_argument("--checkpoint_freq", type=int, default=1)
    parser.add_argument("--fail_after_epoch", type=int, default=1)
    parser.add_argument("--num_to_keep", type=int, default=2)
    args = parser.parse_args()

    storage_path = args.storage_path or tempfile.mkdtemp(prefix="outlast_checkpoints_")
    run_name = args.run_name or f"checkpoints-{uuid.uuid4().hex[:8]}"

    trainer = TorchTrainer(
        train_fn,
        train_loop_config={
            "num_epochs": args.num_epochs, "checkpoint_freq": args.checkpoint_freq,
            "fail_after_epoch": args.fail_after_epoch,
        },
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=run_name,
            storage_path=storage_path,
            failure_config=FailureConfig(max_failures=1),
            checkpoint_config=CheckpointConfig(num_to_keep=args.num_to_keep),
        ),
    )
    result = trainer.fit()

    print(f"final metrics: {result.metrics}")
    print(f"resumed at epoch {result.metrics['start_epoch']}")
    # The latest checkpoint, read back after training the same way the workers restore it.
    with result.checkpoint.as_directory() as checkpoint_dir:
        last_epoch = torch.load(os.path.join(checkpoint_dir, EXTRA_STATE_FILE))["epoch"]
    print(f"latest checkpoint: {result.checkpoint.path} (epoch {last_epoch})")
    for kept_checkpoint, kept_metrics in result.best_checkpoints:
        print(f"kept checkpoint of epoch {kept_metrics['epoch']}: {kept_checkpoint.path}")
    if os.path.isdir(result.path):  # a local storage path: look at what is left on disk
        kept = sorted(d for d in os.listdir(result.path) if d.startswith("checkpoint_"))
        print(f"checkpoints kept on storage ({len(kept)}): {', '.join(kept)}")


if __name__ == "__main__":
    main()
