"""Train functions that use the Ray Train names outlast added, for tests/integration/test_ray_api.py.

Defined in a module (not in the test) so workers import them by reference.
"""

from __future__ import annotations

import json
import os
import tempfile


def every_name_loop(config):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from outlast import train
    from outlast.train import Checkpoint
    from outlast.train.torch import enable_reproducibility, get_devices, prepare_data_loader, prepare_model

    enable_reproducibility(seed=7)
    ctx = train.get_context()
    rank = ctx.get_world_rank()
    loader = prepare_data_loader(DataLoader(TensorDataset(torch.arange(16.0)), batch_size=4))
    shard = train.get_dataset_shard("train")
    whole = train.get_dataset_shard("validation")
    seen = [int(v) for b in shard.iter_torch_batches(batch_size=2) for v in b["x"]]
    # BatchNorm keeps running statistics that differ per rank: every rank saving model.pt, as
    # Ray's tutorial does, writes different bytes.
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(1, 2), torch.nn.BatchNorm1d(2)))
    model(torch.full((4, 1), float(rank + 1)))
    for epoch in range(3):
        with tempfile.TemporaryDirectory() as d:
            torch.save(model.module.state_dict(), os.path.join(d, "model.pt"))
            ckpt = Checkpoint.from_directory(d)
            ckpt.set_metadata({"epoch": epoch})
            train.report({"loss": [3.0, 1.0, 2.0][epoch], "epoch": epoch}, checkpoint=ckpt,
                         checkpoint_dir_name=f"epoch_{epoch}")
    train.report({"loss": 0.1, "epoch": 99})  # a report without a checkpoint: not Result.metrics
    reported = train.get_all_reported_checkpoints()
    with open(config["events"], "a") as f:
        f.write(json.dumps({
            "rank": rank, "devices": [str(d) for d in get_devices()], "seen": seen,
            "whole": sum(1 for _ in whole.iter_rows()),
            "loader": [type(loader.dataset).__name__, loader.batch_size, len(loader)],
            "reported": [[r.metrics["epoch"], r.checkpoint.get_metadata()] for r in reported],
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "env": os.environ.get("RAYCOMPAT_ENV"),
        }) + "\n")
    return {"rank": rank, "seen": len(seen)}


def failing_loop(config):
    raise ValueError("the loop's own error")
