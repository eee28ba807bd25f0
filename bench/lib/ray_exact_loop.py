"""The Ray 2.60 side of bench/data_exactness.py: the loop of bench/lib/exact_loop.py as a Ray Train user writes
it, run by a TorchTrainer of 3 workers on `ray.data.from_items` of the same rows, through kills.

    bench/.ray-venv/bin/python -m bench.lib.ray_exact_loop --events FILE --storage DIR --kills '{"1": 23, ...}'
        [--rows 600] [--epochs 3] [--batch 2] [--cpus 5]

Each step takes one batch of `ray.train.get_dataset_shard("train").iter_torch_batches(batch_size)`, trains the
same float64 model on it (the gradients averaged by one all-reduce), and rank 0 reports a checkpoint (the
epoch, the step, the model and the optimizer) every step; every rank logs the rows it took. A restored
attempt starts at the epoch and step its checkpoint names, and iterates its shard again, as Ray offers no
way to start a shard part way. Rank 1 kills itself (SIGKILL) at the step `--kills` names for its attempt;
FailureConfig(max_failures) starts the group again. Ray has no attempt number in its train context: an
attempt is one more than the kills so far, each kill leaving a marker file before its SIGKILL.

The events (start, used, kill, weights) are those exact_loop writes, so bench/lib/reread.py counts both
alike. The workers import this module: nothing but the standard library at import time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time

from bench.lib.events import emit
from bench.lib.exact_loop import average_gradients, features, target


def ray_exact_loop(config: dict) -> None:
    import ray.train
    import torch
    from ray.train import Checkpoint

    ctx = ray.train.get_context()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    epoch0, step = 0, 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            with open(os.path.join(d, "state.json")) as f:
                saved = json.load(f)
            state = torch.load(os.path.join(d, "model.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch0, step = saved["epoch"], saved["step"] + 1
    markers = config["markers"]
    attempt, rank = len(os.listdir(markers)) + 1, ctx.get_world_rank()
    emit(config["events"], event="start", attempt=attempt, rank=rank, world=ctx.get_world_size(),
         restored_step=step - 1 if ckpt is not None else None, restored_epoch=epoch0 if ckpt is not None else None,
         time=time.time())
    shard = ray.train.get_dataset_shard("train")
    kill_at = config["kills"].get(str(attempt))
    for epoch in range(epoch0, config["epochs"]):
        # A new pass over the shard each epoch, from its start: a restored epoch is read again whole.
        for batch in shard.iter_torch_batches(batch_size=config["batch"], device="cpu"):
            if rank == 1 and kill_at is not None and step >= kill_at:
                emit(config["events"], event="kill", attempt=attempt, step=step, time=time.time())
                open(os.path.join(markers, f"kill-{attempt}"), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            x = features(batch["i"])
            loss = ((model(x).squeeze(1) - target(x)) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            average_gradients(model, ctx.get_world_size())
            optimizer.step()
            emit(config["events"], event="used", attempt=attempt, rank=rank, step=step, epoch=epoch,
                 rows=batch["i"].tolist(), time=time.time())
            with tempfile.TemporaryDirectory() as d:
                checkpoint = None
                if rank == 0:
                    with open(os.path.join(d, "state.json"), "w") as f:
                        json.dump({"epoch": epoch, "step": step}, f)
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                               os.path.join(d, "model.pt"))
                    checkpoint = Checkpoint.from_directory(d)
                ray.train.report({"step": step, "epoch": epoch, "loss": loss.item()}, checkpoint=checkpoint)
            step += 1
    if rank == 0:
        emit(config["events"], event="weights", attempt=attempt, step=step,
             weights={k: [float(v).hex() for v in t.flatten().tolist()] for k, t in model.state_dict().items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--kills", default="{}", help="attempt -> the step at which rank 1 kills itself, as JSON")
    p.add_argument("--rows", type=int, default=600)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--cpus", type=int, default=5,
                   help="Ray's logical CPUs: one per train worker, the rest for Ray Data's tasks")
    args = p.parse_args()

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    kills = json.loads(args.kills)
    markers = os.path.join(args.storage, "kill-markers")
    os.makedirs(markers, exist_ok=True)
    ray.init(num_cpus=args.cpus, include_dashboard=False)
    started = time.time()
    result = TorchTrainer(
        ray_exact_loop, datasets={"train": ray.data.from_items([{"i": i} for i in range(args.rows)])},
        train_loop_config={"events": args.events, "epochs": args.epochs, "batch": args.batch, "kills": kills,
                           "markers": markers},
        scaling_config=ScalingConfig(num_workers=3),
        run_config=RunConfig(name="exact", storage_path=args.storage,
                             failure_config=FailureConfig(max_failures=len(kills) + 2),
                             checkpoint_config=CheckpointConfig(num_to_keep=2))).fit()
    emit(args.events, event="fit_end", took_s=time.time() - started,
         error=None if result.error is None else repr(result.error))
    ray.shutdown()


if __name__ == "__main__":
    main()
