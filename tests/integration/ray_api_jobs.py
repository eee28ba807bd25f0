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
            "reported": [[r.metrics["epoch"], r.checkpoint.get_metadata(), os.path.basename(r.checkpoint.path)]
                         for r in reported],
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "env": os.environ.get("RAYCOMPAT_ENV"),
        }) + "\n")
    return {"rank": rank, "seen": len(seen)}


def failing_loop(config):
    raise ValueError("the loop's own error")


def fsdp2_full_model_loop(config):
    """Ray's FSDP2 tutorial, on CPU and small: a model sharded with `fully_shard`, a sharded checkpoint per
    epoch (DCP, every rank, outlast's names), then `save_model_for_inference`: the full state dict gathered,
    rank 0 saving full-model.pt, every rank reporting with checkpoint_dir_name="full_model"."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from outlast import train
    from outlast.train import Checkpoint

    torch.manual_seed(0)
    rank = train.get_context().get_world_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(config.get("epochs", 2)):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with tempfile.TemporaryDirectory() as d:
            dcp.save({"model": model.state_dict()}, checkpoint_id=d)
            train.report({"loss": loss.item(), "epoch": epoch}, checkpoint=Checkpoint.from_directory(d))
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if rank == 0:
            torch.save(state, os.path.join(d, "full-model.pt"))
            checkpoint = Checkpoint.from_directory(d)
        train.report({}, checkpoint=checkpoint, checkpoint_dir_name="full_model")


def named_twice_loop(config):
    """Reports two checkpoints under `config["names"]`, rank 0 only; the second clashes when they are alike."""
    from outlast import train
    from outlast.train import Checkpoint

    for i, name in enumerate(config["names"]):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "n.json"), "w") as f:
                json.dump({"report": i}, f)
            ckpt = Checkpoint.from_directory(d) if train.get_context().get_world_rank() == 0 else None
            train.report({"report": i}, checkpoint=ckpt, checkpoint_dir_name=name)
        train.collective.barrier()  # rank 0 returns from report() once committed: the others wait for that
