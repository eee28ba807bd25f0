"""The train loop of bench/data_exactness.py: each step takes one batch of `get_dataset_shard("train")` (an
outlast.data parquet dataset), all-reduces, reports a checkpoint (rank 0's: the epoch and step) and logs the
rows it took; rank 1 kills itself (SIGKILL) at the step `config["kills"]` names for its attempt.

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
    import torch.distributed as dist

    from outlast import train
    from outlast.train import Checkpoint

    ctx = train.get_context()
    epoch0, step = 0, 0
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d, open(os.path.join(d, "state.json")) as f:
            saved = json.load(f)
        epoch0, step = saved["epoch"], saved["step"] + 1
    attempt, rank = ctx.get_attempt(), ctx.get_world_rank()
    emit(config["events"], event="start", attempt=attempt, rank=rank, world=ctx.get_world_size(),
         restored_step=step - 1 if ckpt is not None else None, restored_epoch=epoch0 if ckpt is not None else None)
    shard = train.get_dataset_shard("train").iter_torch_batches(batch_size=config["batch"], device="cpu")
    kill_at = config["kills"].get(str(attempt))
    for epoch in range(epoch0, config["epochs"]):
        for batch in shard:
            dist.all_reduce(torch.ones(1))
            if rank == 1 and kill_at is not None and step >= kill_at:
                emit(config["events"], event="kill", attempt=attempt, step=step)
                os.kill(os.getpid(), signal.SIGKILL)
            emit(config["events"], event="used", attempt=attempt, rank=rank, step=step, epoch=epoch,
                 rows=batch["i"].tolist())
            checkpoint = None
            if rank == 0:
                d = tempfile.mkdtemp()
                with open(os.path.join(d, "state.json"), "w") as f:
                    json.dump({"epoch": epoch, "step": step}, f)
                checkpoint = Checkpoint.from_directory(d)
            train.report({"step": step, "epoch": epoch}, checkpoint=checkpoint)
            step += 1
            time.sleep(config.get("step_sleep", 0.0))
