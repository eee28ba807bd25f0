"""The loop of bench/live_recovery_fit.py: 2 CPU ranks, a small MLP, ~20 ms steps, under outlast's
Trainer.fit(), with live recovery (`LiveTraining`) or without it (DDP, a checkpoint every
`ckpt_every` steps, restored after a restart). `config["fsdp"]`: the MLP is FSDP2's, HSDP over replicas of
`shards` ranks: over `live_mesh` with live recovery, over `init_device_mesh` of the run's default group without
(no checkpoints then). Each rank appends one event per step to `events`:
"step" when it applied the step, "thrown" when live recovery threw it away. The workers import this
module: standard library only at import time."""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import time

from bench.lib.events import emit


def _batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)  # a step run again reads the batch it read first
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def loop(config: dict) -> None:
    import torch

    from outlast import train
    from outlast.train.torch import prepare_model

    torch.set_num_threads(1)
    ctx = train.get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    incarnation = int(os.environ.get("OUTLAST_LIVE_INCARNATION", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    step = 0
    ckpt = None if config["live"] else train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        step = state["step"] + 1
    if config.get("fsdp"):
        model = _fully_sharded(model, config["live"], config["shards"], ctx.get_world_size())
    else:
        model = prepare_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if ckpt is not None:
        opt.load_state_dict(state["optim"])
    live = None
    if config["live"] and config.get("fsdp"):
        from outlast.train.torch import LiveTraining

        live = LiveTraining(model, opt, mesh=model.live_mesh)
        step = live.start()
    elif config["live"]:
        from outlast.train.torch import LiveTraining

        if config.get("shards", 1) > 1:  # the optimizer's state split: SGD's momentum over this rank's shard
            live = LiveTraining(model, functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
                                shards=config["shards"])
        else:
            live = LiveTraining(model, opt)
        step = live.start()
    emit(config["events"], ev="start", rank=rank, attempt=attempt, incarnation=incarnation, pid=os.getpid(),
         step=step, t=time.time())
    while step < config["steps"]:
        x, y = _batch(step, rank)
        with live.forward_backward() if live is not None else contextlib.nullcontext():
            torch.nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(config["pad_s"])  # the rest of a ~20 ms step
        done = step
        if live is not None:
            step = live.step(step)
        else:
            opt.step()
            opt.zero_grad()
            step += 1
        applied = step == done + 1
        emit(config["events"], ev="step" if applied else "thrown", rank=rank, attempt=attempt,
             incarnation=incarnation, pid=os.getpid(), step=done, t=time.time())
        if not applied:
            continue
        every = config["ckpt_every"]
        if every and rank == 0 and (done + 1) % every == 0:
            with tempfile.TemporaryDirectory() as tmp:
                torch.save({"model": model.module.state_dict() if hasattr(model, "module") else model.state_dict(),
                            "optim": opt.state_dict(), "step": done}, os.path.join(tmp, "state.pt"))
                train.report({"step": done}, checkpoint=train.Checkpoint.from_directory(tmp))
        elif every:
            train.report({"step": done})
    if live is not None:
        live.close()


def _fully_sharded(model, live: bool, shards: int, world: int):
    """The MLP's two linear layers and the whole FSDP2's, over `live_mesh` or a mesh of the default group."""
    from torch.distributed.fsdp import fully_shard

    if live:
        from outlast.train.torch import live_mesh

        mesh = live_mesh(shards)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // shards, shards), mesh_dim_names=("replicate", "shard"))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.live_mesh = mesh
    return model
