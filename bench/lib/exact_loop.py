"""The train loop of bench/data_exactness.py: each step takes one batch of `get_dataset_shard("train")` (an
outlast.data parquet dataset; with `config["virtual_ranks"]`, a batch of each virtual rank the rank holds, their
gradients reduced by `virtual_rank_gradients`, so that a step is the same at any world size), trains a small
model on it (float64, SGD with momentum, the gradients averaged over the ranks), reports a
checkpoint (rank 0's: the epoch, the step, the model's and the optimizer's state) and logs the rows it took;
rank 1 kills itself (SIGKILL) at the step `config["kills"]` names for its attempt. At the end rank 0 logs the
model's final weights, each float in hex, so that two runs compare bit for bit.

The workers import this module: nothing but the standard library at import time.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time

from bench.lib.events import emit


def exact_loop(config: dict) -> None:
    import torch

    from outlast import train
    from outlast.train import Checkpoint
    from outlast.train.torch import virtual_rank_gradients

    ctx = train.get_context()
    torch.manual_seed(0)  # the same initial weights in every run (DDP broadcasts rank 0's in any case)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    epoch0, step = 0, 0
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            with open(os.path.join(d, "state.json")) as f:
                saved = json.load(f)
            state = torch.load(os.path.join(d, "model.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch0, step = saved["epoch"], saved["step"] + 1
    attempt, rank = ctx.get_attempt(), ctx.get_world_rank()
    emit(config["events"], event="start", attempt=attempt, rank=rank, world=ctx.get_world_size(),
         restored_step=step - 1 if ckpt is not None else None, restored_epoch=epoch0 if ckpt is not None else None)
    shard = train.get_dataset_shard("train").iter_torch_batches(batch_size=config["batch"], device="cpu")
    kill_at = config["kills"].get(str(attempt))
    def loss_of(batch):
        x = features(batch["i"])
        return ((model(x).squeeze(1) - target(x)) ** 2).mean()

    for epoch in range(epoch0, config["epochs"]):
        for batch in shard:
            if rank == 1 and kill_at is not None and step >= kill_at:
                emit(config["events"], event="kill", attempt=attempt, step=step, time=time.time())
                os.kill(os.getpid(), signal.SIGKILL)
            if config.get("virtual_ranks"):
                # One batch per virtual rank held: the step's rows and gradients are the same at any world size.
                loss = torch.stack(virtual_rank_gradients(model, batch, loss_of)).mean()
                rows = [i for part in batch for i in part["i"].tolist()]
            else:
                loss = loss_of(batch)
                optimizer.zero_grad()
                loss.backward()
                average_gradients(model, ctx.get_world_size())
                rows = batch["i"].tolist()
            optimizer.step()
            emit(config["events"], event="used", attempt=attempt, rank=rank, step=step, epoch=epoch,
                 rows=rows, time=time.time())
            checkpoint = None
            if rank == 0:
                d = tempfile.mkdtemp()
                with open(os.path.join(d, "state.json"), "w") as f:
                    json.dump({"epoch": epoch, "step": step}, f)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                           os.path.join(d, "model.pt"))
                checkpoint = Checkpoint.from_directory(d)
            train.report({"step": step, "epoch": epoch, "loss": loss.item()}, checkpoint=checkpoint)
            step += 1
            slow = config.get("slow_from") is not None and step >= config["slow_from"]
            time.sleep(config["slow_step_sleep"] if slow else config.get("step_sleep", 0.0))
    if rank == 0:
        emit(config["events"], event="weights", attempt=attempt, step=step,
             weights={k: [float(v).hex() for v in t.flatten().tolist()] for k, t in model.state_dict().items()})


def average_gradients(model, world: int) -> None:
    """The gradients averaged over the ranks in one all-reduce of one flat tensor, laid out the same at every
    step. Not DDP: it lays its buckets out again after its first step, so a restored attempt's first step
    all-reduces in another layout than the same step of a run without faults, and at 3 ranks gloo's ring sums
    an element in an order that depends on its place in the tensor (49 random floats all-reduced at 3
    ranks, then the same reversed: 9 sums changed in the last bit). With DDP, a run of this loop with 3
    kills ended 1.1e-16 from the run without faults, every step's rows the same in both."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def features(i):
    """Four features of row `i`, in [-1, 1]."""
    import torch

    t = i.double().unsqueeze(1) / 300.0 - 1.0
    return torch.cat([t, t ** 2, torch.sin(3 * t), torch.cos(5 * t)], dim=1)


def target(x):
    return 0.5 * x[:, 0] - x[:, 1] + 0.25 * x[:, 2] * x[:, 3]
