"""Job driver fault tolerance: relaunch the same command and the run continues where it stopped.

Ports the "Job Driver Fault Tolerance" section (its `entrypoint.py` example) of Ray
Train's "Handling Failures and Node Preemption" user guide to outlast.

The driver is the process that calls `trainer.fit()`. If it dies (Ctrl+C, its machine
crashes, the whole node goes away), start the same command again. The run's state and
its committed checkpoints live under `{storage_path}/{run_name}`, so a new driver given
the same pair finds them and the new workers restore the latest checkpoint. Whoever
launches the job picks the pair and passes it in; a fresh run needs a fresh name,
because reusing one resumes that run (or, once it has finished, just returns its
result without training again). Driver restarts do not count against
`FailureConfig.max_failures`, which covers worker failures only.

    python examples/entrypoint.py --storage_path /shared/results --run_name unique_run_id=da823d5
    # ... the driver is killed; later, the very same command resumes the run:
    python examples/entrypoint.py --storage_path /shared/results --run_name unique_run_id=da823d5

`--epoch_seconds` stretches every epoch so there is time to interrupt the driver.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch import nn

import outlast.train
import outlast.train.torch
from outlast.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from outlast.train.torch import TorchTrainer


def train_fn_per_worker(config: dict) -> None:
    rank = outlast.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    # [1] Restore the worker's state from the latest checkpoint of this run, if any:
    # after a worker failure, and equally after the whole driver was relaunched.
    start_epoch = 0
    checkpoint = outlast.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as checkpoint_dir:
            state = torch.load(os.path.join(checkpoint_dir, "state.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
        if rank == 0:
            print(f"resuming from the checkpoint of epoch {state['epoch']}", flush=True)

    model = outlast.train.torch.prepare_model(model)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 2, generator=g)
    y = 2.0 * x[:, :1] - x[:, 1:]

    for epoch in range(start_epoch, config["num_epochs"]):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(config["epoch_seconds"])  # stands in for a long epoch

        # [2] Save from rank 0 and report from every rank.
        with tempfile.TemporaryDirectory() as tmp:
            to_report = None
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch}, os.path.join(tmp, "state.pt"))
                to_report = Checkpoint.from_directory(tmp)
            outlast.train.report({"epoch": epoch, "loss": loss.item(), "start_epoch": start_epoch},
                                 checkpoint=to_report)
        if rank == 0:
            print(f"epoch {epoch} done (loss {loss.item():.4f})", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage_path", type=str, required=True)
    parser.add_argument("--run_name", type=str, required=True)
    parser.add_argument("--num_epochs", type=int, default=8)
    parser.add_argument("--epoch_seconds", type=float, default=0.5)
    args = parser.parse_args()

    print(f"driver pid {os.getpid()}: run {args.run_name!r} at {args.storage_path}", flush=True)
    trainer = TorchTrainer(
        train_fn_per_worker,
        train_loop_config={"num_epochs": args.num_epochs, "epoch_seconds": args.epoch_seconds},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            # [3] Worker failures are retried within this driver, up to 3 times.
            failure_config=FailureConfig(max_failures=3),
            # [4] The job submitter chooses the (storage_path, name) pair and passes it
            # in, so that relaunching the same command finds the same run.
            storage_path=args.storage_path,
            name=args.run_name,
        ),
    )
    result = trainer.fit()
    print(f"final metrics: {result.metrics}", flush=True)
    print(f"latest checkpoint: {result.checkpoint}", flush=True)
    if result.metrics is not None:
        # The metrics of the run's last report, whichever driver made it.
        print(f"the last attempt started at epoch {result.metrics['start_epoch']}", flush=True)
        print(f"finished at epoch {result.metrics['epoch']}", flush=True)
