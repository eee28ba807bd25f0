"""A sharded checkpoint saved at one world size and restored at another, in an elastic run.

Each rank holds a shard of the weights (a DTensor sharded over the attempt's ranks) and saves
only its shard with `torch.distributed.checkpoint` (DCP) into a directory of its own, which it
reports; outlast commits the ranks' files as one checkpoint (DCP's `.metadata` from rank 0, a
`__<rank>_0.distcp` per rank). When the run restarts at another size (a node lost, or one
joined: `ScalingConfig(num_workers=(min, max))`), every rank gets that whole checkpoint and
`dcp.load` reads the slices its new shard needs: re-sharding is DCP's, not outlast's. The
loop also saves on `get_preemption_info()` (reason "resize" when the run grows), so a grow
loses no step.

Run it on a cluster whose nodes offer one CPU each, and add a node while it trains:

    outlast start --num-cpus 1; outlast start --address HEAD --num-cpus 1
    python examples/elastic_dcp_checkpoint.py --storage_path DIR --run_name dcp &
    outlast start --address HEAD --num-cpus 1        # the run grows onto it
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import outlast.train
from outlast.train import Checkpoint, RunConfig, ScalingConfig
from outlast.train.torch import TorchTrainer


def train_func(config: dict) -> None:
    ctx = outlast.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    weights = distribute_tensor(torch.zeros(config["size"]), mesh, [Shard(0)])  # this rank's shard only

    start = 0
    checkpoint = outlast.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            dcp.load({"weights": weights}, checkpoint_id=d)  # reads the slices of this rank's new shard
            with open(os.path.join(d, "step.json")) as f:
                saved = json.load(f)
        start = saved["step"] + 1
        expected = torch.arange(config["size"], dtype=torch.float32) + start  # what training made of it
        ok = torch.equal(weights.full_tensor(), expected)
        print(f"rank {rank}: restored step {saved['step']} at world size {world} from a checkpoint written at "
              f"world size {saved['world']}: {'every value as saved' if ok else 'VALUES DIFFER'}", flush=True)
    else:
        weights = distribute_tensor(torch.arange(config["size"], dtype=torch.float32), mesh, [Shard(0)])

    def save(step: int) -> None:
        with tempfile.TemporaryDirectory() as d:
            dcp.save({"weights": weights}, checkpoint_id=d)  # every rank writes its own shard
            if rank == 0:
                with open(os.path.join(d, "step.json"), "w") as f:
                    json.dump({"step": step, "world": world}, f)
            outlast.train.report({"step": step, "world": world}, checkpoint=Checkpoint.from_directory(d))

    saved_on_notice = False
    for step in range(start, config["steps"]):
        weights = weights + 1  # a training step on the shard
        time.sleep(config["step_s"])
        info = outlast.train.get_preemption_info()
        if info is not None and not saved_on_notice:
            saved_on_notice = True
            save(step)
        elif (step + 1) % config["checkpoint_every"] == 0:
            save(step)
        else:
            outlast.train.report({"step": step, "world": world})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage_path", default=None)
    p.add_argument("--run_name", default="elastic_dcp")
    p.add_argument("--min_workers", type=int, default=1)
    p.add_argument("--max_workers", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step_s", type=float, default=0.05)
    p.add_argument("--checkpoint_every", type=int, default=20)
    p.add_argument("--resize_interval_s", type=float, default=0.0)
    args = p.parse_args()
    result = TorchTrainer(
        train_func,
        train_loop_config={"steps": args.steps, "step_s": args.step_s, "checkpoint_every": args.checkpoint_every,
                           "size": 12},
        scaling_config=ScalingConfig(num_workers=(args.min_workers, args.max_workers),
                                     resources_per_worker={"CPU": 1},
                                     elastic_resize_monitor_interval_s=args.resize_interval_s),
        run_config=RunConfig(name=args.run_name, storage_path=args.storage_path or tempfile.mkdtemp()),
    ).fit()
    print(f"finished: {result.metrics}")


if __name__ == "__main__":
    main()
