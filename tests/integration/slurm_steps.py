"""A driver for Slurm tests: two ranks on two nodes (SPREAD), one all-reduce a step (lock step, as DDP), a
checkpoint every 10 steps and one just in time; every rank appends JSON events to --events: each step once
its report returned, and the notice as its PreemptionInfo reads.

    python tests/integration/slurm_steps.py --storage DIR --name NAME --events FILE [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def emit(path: str, **event) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({**event, "t": time.time()}) + "\n")


def train_loop(config: dict) -> None:
    import torch
    import torch.distributed as dist

    from outlast import train
    from outlast.train import Checkpoint

    ctx = train.get_context()
    events, rank, attempt = config["events"], ctx.get_world_rank(), ctx.get_attempt()
    start, restored = 0, None
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d, open(os.path.join(d, "state.json")) as f:
            restored = json.load(f)["step"]
        start = restored + 1
    emit(events, ev="start", rank=rank, attempt=attempt, restored=restored)
    jit_saved = False
    for step in range(start, config["steps"]):
        x = torch.ones(1)
        dist.all_reduce(x)
        time.sleep(config["step_s"])
        info = train.get_preemption_info()
        save = (step + 1) % 10 == 0
        if info is not None and not jit_saved:
            emit(events, ev="notice", rank=rank, attempt=attempt, step=step, node_ids=info.preempted_node_ids,
                 ranks=info.preempted_ranks, node_to_ranks=info.preempted_node_to_ranks)
            jit_saved = save = True
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if save and rank == 0:
                with open(os.path.join(d, "state.json"), "w") as f:
                    json.dump({"step": step}, f)
                checkpoint = Checkpoint.from_directory(d)
            train.report({"step": step, "jit": bool(info is not None and save)}, checkpoint=checkpoint)
        emit(events, ev="step", rank=rank, attempt=attempt, step=step)


def main() -> None:
    from outlast.train import FailureConfig, RunConfig, ScalingConfig
    from outlast.train.torch import TorchTrainer

    p = argparse.ArgumentParser()
    p.add_argument("--storage", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-s", type=float, default=0.05)
    args = p.parse_args()
    TorchTrainer(train_loop, train_loop_config={"events": args.events, "steps": args.steps, "step_s": args.step_s},
                 scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
                 run_config=RunConfig(name=args.name, storage_path=args.storage,
                                      failure_config=FailureConfig(max_preemption_failures=-1))).fit()


if __name__ == "__main__":
    main()
