"""The steps of the elastic scenarios' loop, the same on Ray Train V2 and on outlast (`train` is
`ray.train` or `outlast.train`). The workers import this module: standard library only at import."""

from __future__ import annotations

import time

from bench.lib import step_checkpoint
from bench.lib.events import emit


def train_steps(train, events: str, steps: range, step_s: float, rank: int, **where) -> None:
    """Each step sleeps ~`step_s`, all-reduces one number over the process group (lock step, as DDP),
    asks for a preemption notice, logs itself to `events` (with `where`: the world size and whatever
    tells the attempt apart), then reports; rank 0's report carries a checkpoint every 10 steps, and
    once more, just in time, on the first notice."""
    import torch
    import torch.distributed as dist

    jit_saved = False
    grad = torch.zeros(1)
    for step in steps:
        time.sleep(step_s)
        dist.all_reduce(grad)
        info = train.get_preemption_info()
        jit = info is not None and not jit_saved
        jit_saved = jit_saved or jit
        # Logged before report(): a step is done once computed; a grow's report() blocks until the restart.
        emit(events, ev="step", rank=rank, step=step, t=time.time(), **where)
        step_checkpoint.report(train, {"step": step}, step, save=(jit or step % 10 == 0) and rank == 0)
