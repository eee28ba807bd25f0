"""The train script of bench/slurm.py, for outlast or Ray Train (the same loop, the same API).

    python -m bench.lib.slurm_train --framework outlast|ray --storage DIR --name NAME --events FILE
        [--steps 100000] [--step-s 0.05] [--address RAY_HEAD]

Two workers, gloo, one all-reduce a step (lock step, as DDP), a checkpoint every 10 steps and
one more, just in time, the first time get_preemption_info() is not None. Every rank appends
JSON events (time, step, the notice) to --events.
"""

from __future__ import annotations

import argparse
import os
import time

from bench.lib import step_checkpoint
from bench.lib.events import emit
from bench.lib.train_api import load_api


def train_loop(config: dict) -> None:
    import torch
    import torch.distributed as dist

    train = load_api(config["framework"]).train
    events, rank = config["events"], train.get_context().get_world_rank()
    restored = step_checkpoint.restored_step(train)
    start = 0 if restored is None else restored + 1
    emit(events, ev="attempt_start", rank=rank, restored_from=restored, t=time.time(),
         job=os.environ.get("SLURM_JOB_ID"), restarts=os.environ.get("SLURM_RESTART_COUNT", "0"))
    jit_saved = False
    for step in range(start, config["steps"]):
        x = torch.ones(1)
        dist.all_reduce(x)
        time.sleep(config["step_s"])
        emit(events, ev="step", rank=rank, step=step, t=time.time())
        info = train.get_preemption_info()
        save = (step + 1) % 10 == 0
        if info is not None and not jit_saved:
            emit(events, ev="notice", rank=rank, step=step, t=time.time())
            jit_saved = save = True
        step_checkpoint.report(train, {"step": step, "jit": bool(info is not None and save)}, step,
                               save=save and rank == 0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=["outlast", "ray"], required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--address", default=None)
    args = p.parse_args()
    config = {"framework": args.framework, "events": args.events, "steps": args.steps, "step_s": args.step_s}
    if args.framework == "ray":
        import ray

        ray.init(address=args.address)
    api = load_api(args.framework)
    api.TorchTrainer(train_loop, train_loop_config=config, scaling_config=api.ScalingConfig(num_workers=2),
                     run_config=api.RunConfig(name=args.name, storage_path=args.storage,
                                              failure_config=api.FailureConfig(max_failures=-1))).fit()


if __name__ == "__main__":
    main()
