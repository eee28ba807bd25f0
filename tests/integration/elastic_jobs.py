"""Train functions for the elastic-run tests, importable by the workers."""

from __future__ import annotations

import json
import os
import tempfile
import time

from outlast import train
from outlast.train import Checkpoint
from tests.integration.jobs import _restored_start, log_event


def elastic_torch_loop(config: dict) -> None:
    """A gloo all_reduce every step over the attempt's world; the data loader sharded for it; a checkpoint
    every `every` steps and on a notice (a drain's or a resize's), the guide's pattern."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from outlast.train.torch import prepare_data_loader

    ctx = train.get_context()
    start, ckpt = _restored_start()
    loader = prepare_data_loader(DataLoader(TensorDataset(torch.arange(120, dtype=torch.float32)), batch_size=1))
    log_event(config, event="start", restored_step=start - 1 if ckpt else None, world=ctx.get_world_size(),
              dist_world=dist.get_world_size(), shard=len(loader), node_id=os.environ.get("OUTLAST_NODE_ID"))
    saved = False
    for step in range(start, config["steps"]):
        total = torch.ones(1)
        dist.all_reduce(total)  # every rank of this attempt, as a gradient all-reduce
        info = train.get_preemption_info()
        save = (step + 1) % config.get("every", 10) == 0
        if info is not None and not saved:
            saved = save = True
            log_event(config, event="notice", step=step, reason=info.reason, ranks=info.ranks)
        checkpoint = None
        if save and ctx.get_world_rank() == 0:
            d = tempfile.mkdtemp()
            with open(os.path.join(d, "state.json"), "w") as f:
                json.dump({"step": step}, f)
            checkpoint = Checkpoint.from_directory(d)
        train.report({"step": step, "world": int(total.item())}, checkpoint=checkpoint)
        log_event(config, event="step", step=step, world=int(total.item()))
        time.sleep(config.get("step_sleep", 0.0))


def wedging_loop(config: dict) -> None:
    """Attempt 1: at step `wedge_at`, rank 1 sleeps forever between two all_reduces, so rank 0 waits in the
    next one; later attempts train to the end."""
    import torch
    import torch.distributed as dist

    ctx = train.get_context()
    log_event(config, event="start")
    for step in range(config["steps"]):
        total = torch.ones(1)
        dist.all_reduce(total)
        train.report({"step": step})
        if ctx.get_attempt() == 1 and step == config["wedge_at"] and ctx.get_world_rank() == 1:
            sleep_forever()
        time.sleep(config.get("step_sleep", 0.0))
    log_event(config, event="end")


def sleep_forever() -> None:
    log_event({"events": os.environ["OUTLAST_TEST_EVENTS"]}, event="wedged")
    time.sleep(3600)
