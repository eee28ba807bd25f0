"""A train loop that reads its data through get_dataset_shard (rows in memory, and an outlast.data Dataset of parquet
row groups of uneven sizes, read a block at a time) and prepare_data_loader, each built once and walked every epoch,
and logs the rows of every step; a driver for it, for the tests that kill or relaunch one.

    python -m tests.integration.data_jobs STORAGE EVENTS [--workers W] [--epochs E] [--step-sleep S]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from collections import Counter

from outlast import train
from outlast.train import Checkpoint
from tests.integration.jobs import _fault, log_event, read_events

ROWS = 48  # rows of the dataset: split evenly between 1, 2, 3 and 4 ranks
BATCH = 2
ROW_GROUP = 5  # the parquet dataset's row groups: 9 of 5 rows and one of 3, none on a rank's boundary
KINDS = ("shard", "loader", "stream")


def data_loop(config: dict) -> None:
    """Each step takes one batch of the shard and one of the prepared loader, all-reduces, reports a checkpoint
    (rank 0's files: the epoch and step), and logs the rows it took."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from outlast.train.torch import prepare_data_loader

    ctx = train.get_context()
    epoch0, step = 0, 0
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d, open(os.path.join(d, "state.json")) as f:
            saved = json.load(f)
        epoch0, step = saved["epoch"], saved["step"] + 1
    log_event(config, event="start", restored_step=step - 1 if ckpt else None, world=ctx.get_world_size())
    shard = train.get_dataset_shard("train").iter_batches(batch_size=BATCH, local_shuffle_buffer_size=ROWS,
                                                          local_shuffle_seed=1)
    loader = prepare_data_loader(DataLoader(TensorDataset(torch.arange(ROWS)), batch_size=BATCH, shuffle=True))
    stream = train.get_dataset_shard("stream").iter_torch_batches(batch_size=BATCH, local_shuffle_buffer_size=8,
                                                                   local_shuffle_seed=2, device="cpu")
    for epoch in range(epoch0, config["epochs"]):
        for rows, loaded, streamed in itertools.zip_longest(shard, loader, stream):
            dist.all_reduce(torch.ones(1))  # in step with the other ranks, as a gradient's all-reduce keeps them
            _fault(config, step, "step")  # the batches taken, the step not reported
            log_event(config, event="used", step=step, epoch=epoch, shard=rows["i"].tolist(),
                      loader=loaded[0].tolist(), stream=streamed["i"].tolist())
            checkpoint = None
            if ctx.get_world_rank() == 0:
                d = tempfile.mkdtemp()
                with open(os.path.join(d, "state.json"), "w") as f:
                    json.dump({"epoch": epoch, "step": step}, f)
                checkpoint = Checkpoint.from_directory(d)
            train.get_preemption_info()
            train.report({"step": step, "epoch": epoch}, checkpoint=checkpoint)
            step += 1
            time.sleep(config.get("step_sleep", 0.0))


def virtual_loop(config: dict) -> None:
    """Each step reads a batch of each virtual rank the rank holds (`DataConfig(virtual_ranks=...)`), trains a small
    float64 model on them through `virtual_rank_gradients`, reports a checkpoint of the model and the optimizer, and
    logs the rows; rank 0 logs the final weights, each float in hex."""
    import torch

    from outlast.train.torch import virtual_rank_gradients

    ctx = train.get_context()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    epoch0, step = 0, 0
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch0, step = state["epoch"], state["step"] + 1
    log_event(config, event="start", restored_step=step - 1 if ckpt else None, world=ctx.get_world_size())

    def loss_of(batch):
        x = batch["i"].double().unsqueeze(1) / ROWS
        x = torch.cat([x, x.sin(), x.cos()], dim=1)
        return ((model(x).squeeze(1) - (x[:, 0] - 2 * x[:, 1] * x[:, 2])) ** 2).mean()

    shard = train.get_dataset_shard("train").iter_torch_batches(batch_size=1, local_shuffle_buffer_size=ROWS,
                                                                local_shuffle_seed=1, device="cpu")
    for epoch in range(epoch0, config["epochs"]):
        for batches in shard:
            virtual_rank_gradients(model, batches, loss_of)
            optimizer.step()
            log_event(config, event="used", step=step, epoch=epoch,
                      shard=[i for b in batches for i in b["i"].tolist()])
            checkpoint = None
            if ctx.get_world_rank() == 0:
                d = tempfile.mkdtemp()
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                            "step": step}, os.path.join(d, "state.pt"))
                checkpoint = Checkpoint.from_directory(d)
            train.report({"step": step}, checkpoint=checkpoint)
            step += 1
            time.sleep(config.get("step_sleep", 0.0))
    if ctx.get_world_rank() == 0:
        log_event(config, event="weights", weights=[float(v).hex() for p in model.parameters()
                                                    for v in p.detach().flatten().tolist()])


def fit_virtual(storage: str, events: str, scaling, epochs=6, step_sleep=0.0, name="run"):
    """`virtual_loop` on ROWS rows split into 12 virtual ranks (a step reads 12 rows at any world size: 4 steps an
    epoch)."""
    import numpy as np

    from outlast.train import DataConfig, FailureConfig, RunConfig
    from outlast.train.torch import TorchTrainer

    return TorchTrainer(
        virtual_loop, datasets={"train": {"i": np.arange(ROWS)}}, dataset_config=DataConfig(virtual_ranks=12),
        train_loop_config={"events": events, "epochs": epochs, "step_sleep": step_sleep}, scaling_config=scaling,
        run_config=RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(max_failures=0))).fit()


def uses_per_epoch(events_path) -> dict[str, dict[int, Counter]]:
    """For the shard and the loader: epoch -> how often each row was used in a step that counted. A step that
    counted is one no later than the step the next attempt restored (steps after it were taken again)."""
    events = read_events(events_path)
    restored = {e["attempt"]: e["restored_step"] for e in events if e["event"] == "start"}
    out: dict[str, dict[int, Counter]] = {kind: {} for kind in KINDS}
    for e in events:
        if e["event"] != "used":
            continue
        after = restored.get(e["attempt"] + 1, "never")
        if after is None or (after != "never" and e["step"] > after):
            continue
        for kind in out:
            out[kind].setdefault(e["epoch"], Counter()).update(e.get(kind, ()))  # virtual_loop logs the shard
    return out


def fit(storage: str, events: str, workers=3, epochs=2, step_sleep=0.0, fault=None, max_failures=1,
        scaling=None, name="run"):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from outlast import data
    from outlast.train import FailureConfig, RunConfig, ScalingConfig
    from outlast.train.torch import TorchTrainer

    parquet = os.path.join(os.path.dirname(os.path.abspath(events)), "stream.parquet")
    pq.write_table(pa.table({"i": np.arange(ROWS)}), parquet, row_group_size=ROW_GROUP)
    return TorchTrainer(
        data_loop, datasets={"train": {"i": np.arange(ROWS)}, "stream": data.read_parquet(parquet)},
        train_loop_config={"events": events, "epochs": epochs, "step_sleep": step_sleep, "fault": fault},
        scaling_config=scaling or ScalingConfig(num_workers=workers),
        run_config=RunConfig(name=name, storage_path=storage,
                             failure_config=FailureConfig(max_failures=max_failures))).fit()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("storage")
    p.add_argument("events")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    result = fit(args.storage, args.events, args.workers, args.epochs, args.step_sleep)
    print(json.dumps(result.metrics))
