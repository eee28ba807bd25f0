"""Live recovery: a rank dies and the run loses no step, where a restart loses those since its last checkpoint.

Two CPU ranks train a small regression model with `FailureConfig(live_recovery=True)`. On its first
process, rank 0 kills itself (SIGKILL) in step 20. Rank 1 is not stopped: its pending allreduce
fails, it keeps its gradients of step 20, the controller forks a new rank 0 on the node, the new
rank 0 takes the model, the optimizer and the report count from rank 1 and runs step 20's forward
and backward, and both reduce step 20 again. Rank 1 runs no step twice. Every 10 steps the ranks save a
checkpoint in parts (`live.save`), which a restart would restore (`live.load`): no restart happens here, since no
death needs one.

    python examples/live_recovery.py [--storage_path DIR] [--steps N] [--workers 4 --shards 2 [--fsdp]]

With `--shards 2` (and 4 workers), the ranks split Adam's state in two shards, held on ranks 0 and 2 and on
ranks 1 and 3: the new rank 0 takes shard 0 from rank 2. With `--fsdp` too, the model is FSDP2's, its
parameters sharded as well, over `live_mesh(2)`: its reductions run in backward, so step 20 is thrown away on
every rank and run again once the new rank 0 took shard 0's weights and moments from rank 2 (one step lost).

`outlast runs DIR live` then lists the live recovery, its cost and its seconds.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import tempfile

import torch

from outlast import train
from outlast.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from outlast.train.torch import LiveTraining, TorchTrainer, live_mesh, prepare_model

KILL_AT = 20
CHECKPOINT_EVERY = 10


def loop(config: dict) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if config["fsdp"]:  # FSDP2 over a mesh whose groups outlive a rank: each rank holds its shard of everything
        from torch.distributed.fsdp import fully_shard

        mesh = live_mesh(shards=config["shards"])
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        live = LiveTraining(model, torch.optim.Adam(model.parameters(), lr=0.01), mesh=mesh)
    elif config["shards"] > 1:  # each rank's Adam over its shard of the parameters
        model = prepare_model(model)
        live = LiveTraining(model, functools.partial(torch.optim.Adam, lr=0.01), shards=config["shards"])
    else:
        model = prepare_model(model)
        live = LiveTraining(model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9))
    rank = train.get_context().get_world_rank()
    restored = 0
    if (checkpoint := train.get_checkpoint()) is not None:  # a restart: every rank loads its part
        with checkpoint.as_directory() as d:
            restored = live.load(d)
    step = live.start(restored)
    print(f"[rank {rank} pid {os.getpid()}] training from step {step}", flush=True)
    while step < config["steps"]:
        rank = train.get_context().get_world_rank()  # a shrink (an elastic run's lost node) numbers ranks afresh
        # The batch follows from the step and the rank: a step run again reads the same one.
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(64, 3, generator=g)
        with live.forward_backward():  # FSDP2's collectives run in here; without a mesh it does nothing
            loss = ((model(x) - x @ torch.tensor([[3.0], [-2.0], [0.5]])) ** 2).mean()
            loss.backward()
            if rank == 0 and step == KILL_AT and os.environ.get("OUTLAST_LIVE_INCARNATION") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
        # step + 1: a step that broke was reduced again with the replacement (FSDP2: step, thrown away, run again)
        done = live.step(step)
        if done > step and done % CHECKPOINT_EVERY:  # not thrown away by a shrink
            train.report({"step": step, "loss": loss.item()})
        elif done > step:
            with tempfile.TemporaryDirectory() as d:  # each rank writes its part; most ranks have none
                part = live.save(d, step)
                train.report({"step": step, "loss": loss.item()}, checkpoint=Checkpoint.from_directory(d) if part
                             else None)
        step = done
    live.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage_path", default=None)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shards", type=int, default=1, help="split the optimizer's state between this many ranks")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 over live_mesh(shards): the parameters split too")
    args = parser.parse_args()
    storage = args.storage_path or tempfile.mkdtemp(prefix="outlast-live-")
    result = TorchTrainer(
        loop, train_loop_config={"steps": args.steps, "shards": args.shards, "fsdp": args.fsdp},
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(name="live", storage_path=storage,
                             failure_config=FailureConfig(max_failures=3, live_recovery=True)),
    ).fit()
    print(f"finished: {result.last_metrics}; the history: outlast runs {storage} live")


if __name__ == "__main__":
    main()
