"""A just-in-time checkpoint when a node is about to be preempted.

Ports the pattern of Ray Train's `get_preemption_info()` guide to outlast: the loop
trains and checkpoints every `--checkpoint_every` steps as usual; it also asks
`get_preemption_info()` every step, and the first time that is not None (a node of the
run is draining: a spot reclaim, `outlast drain-node`, a SIGTERM to its agent) rank 0
saves a checkpoint at once and the loop goes on. The run restarts from that checkpoint
on nodes that are not draining, losing no step; the restart draws on
`FailureConfig.max_preemption_failures`, not on `max_failures`.

Run it on a cluster (`outlast start`, then `outlast start --address ...` on more
machines), and drain the node its workers run on while it trains:

    python examples/preemption_jit_checkpoint.py --storage_path DIR --run_name jit &
    outlast status                       # the node table: where the workers are
    outlast drain-node --node-id ID --reason preemption --deadline-remaining-seconds 30
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


def train_func(config: dict) -> None:
    rank = outlast.train.get_context().get_world_rank()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    torch.manual_seed(0)
    model = outlast.train.torch.prepare_model(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    start = 0
    checkpoint = outlast.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"] + 1

    def save(step: int, loss: float, preempted: bool) -> None:
        metrics = {"step": step, "loss": loss, "preempted": preempted}
        with tempfile.TemporaryDirectory() as d:
            ckpt = None
            if rank == 0:  # a replicated model: rank 0 saves it
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step}, os.path.join(d, "state.pt"))
                ckpt = Checkpoint.from_directory(d)
            outlast.train.report(metrics, checkpoint=ckpt)

    saved_on_preemption = False
    for step in range(start, config["steps"]):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(config["step_s"])

        preemption_info = outlast.train.get_preemption_info()
        if preemption_info is not None and not saved_on_preemption:
            if rank == 0:
                print(f"step {step}: nodes {preemption_info.preempted_node_ids} (ranks "
                      f"{preemption_info.preempted_ranks}) are being preempted; saving a checkpoint now", flush=True)
            save(step, loss.item(), preempted=True)
            saved_on_preemption = True
        elif (step + 1) % config["checkpoint_every"] == 0:
            save(step, loss.item(), preempted=False)
        else:
            outlast.train.report({"step": step, "loss": loss.item()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage_path", default=None)
    p.add_argument("--run_name", default="preemption_jit")
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--step_s", type=float, default=0.05)
    p.add_argument("--checkpoint_every", type=int, default=50)
    args = p.parse_args()
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"steps": args.steps, "step_s": args.step_s, "checkpoint_every": args.checkpoint_every},
        scaling_config=ScalingConfig(num_workers=args.num_workers),
        run_config=RunConfig(name=args.run_name, storage_path=args.storage_path or tempfile.mkdtemp(),
                             failure_config=FailureConfig(max_preemption_failures=-1)),
    )
    result = trainer.fit()
    print(f"finished: {result.metrics}; checkpoint {result.checkpoint}")


if __name__ == "__main__":
    main()
