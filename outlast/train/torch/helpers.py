"""The usual helpers of a DDP training loop, called inside workers."""

from __future__ import annotations

from typing import Any

from outlast.train._session import get_session
from outlast.train.torch.ddp_layout import can_fix_bucket_layout, fix_bucket_layout
from outlast.trace import mark


def get_devices() -> list:
    """This worker's devices: the GPUs its node gave it (`resources_per_worker={"GPU": 2}` gives two),
    or the CPU when it trains without NCCL."""
    import os

    import torch

    from outlast.agent.gpus import own_device_indices

    ctx = get_session("torch.get_devices").context
    if torch.cuda.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_backend() == "nccl":
        return [torch.device(f"cuda:{i}")
                for i in own_device_indices(os.environ, ctx.local_rank, torch.cuda.device_count())]
    return [torch.device("cpu")]


def get_device():
    """This worker's first device (`cuda:0` for a run of one GPU per rank on a node of one GPU)."""
    return get_devices()[0]


def enable_reproducibility(seed: int = 0) -> None:
    """Seed torch, Python and numpy, and ask torch for deterministic algorithms (which may be slower).

    Results can still differ across machines, library versions and numbers of workers.
    """
    import os
    import random

    import numpy as np
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    # cuBLAS refuses deterministic mode without a fixed workspace.
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"


def _deprecated_amp(name: str):
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"outlast.train.torch.{name}() is not supported (Ray deprecated it too): use "
                           "torch.autocast and torch.amp.GradScaler in the train function")
    refuse.__name__ = name
    return refuse


accelerate = _deprecated_amp("accelerate")
prepare_optimizer = _deprecated_amp("prepare_optimizer")
backward = _deprecated_amp("backward")


def prepare_model(model, move_to_device: bool = True, parallel_strategy: str | None = "ddp",
                  parallel_strategy_kwargs: dict[str, Any] | None = None):
    """Move `model` to this worker's device and wrap it in DistributedDataParallel.

    The buckets are laid out once, before the first step, in an order that depends only on the model
    (`ddp_layout.fix_bucket_layout`): every step reduces its gradients in the same order in every process group, so a
    run restored from a checkpoint takes, bit for bit, the steps the run without the restart took, at any number of
    ranks. Not with `static_graph`, `mixed_precision`, `delay_all_reduce_named_params` or sparse embeddings in
    `parallel_strategy_kwargs`/the model (see docs/guide/failures.md); `find_unused_parameters=True` keeps one
    layout of its own.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import torch

    device = move_to_device if isinstance(move_to_device, torch.device) else get_device()
    if move_to_device:
        model = model.to(device)
    if parallel_strategy is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    if parallel_strategy != "ddp":
        raise ValueError(f"prepare_model: parallel_strategy must be 'ddp' or None, got {parallel_strategy!r}")
    kwargs = dict(parallel_strategy_kwargs or {})
    if device.type == "cuda":
        kwargs.setdefault("device_ids", [device])
    mark("worker.ddp_begin", rank=dist.get_rank())
    wrapped = DistributedDataParallel(model, **kwargs)
    if can_fix_bucket_layout(model, kwargs):
        fix_bucket_layout(wrapped)
    mark("worker.ddp", rank=dist.get_rank())
    return wrapped


def prepare_data_loader(data_loader, add_dist_sampler: bool = True, move_to_device: bool = True,
                        auto_transfer: bool = True):
    """Give each rank its own shard of `data_loader` (a DistributedSampler) and move batches to the device.

    The result reads like the DataLoader it wraps (`.dataset`, `.batch_size`, `.sampler`, `len()`).
    `auto_transfer` (copying the next batch to the GPU on a side stream) is accepted and ignored:
    batches move to the device as they are read.
    """
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

    loader = data_loader
    if add_dist_sampler and dist.is_initialized() and dist.get_world_size() > 1 and \
            not isinstance(data_loader.sampler, DistributedSampler):
        shuffle = not isinstance(data_loader.sampler, SequentialSampler)
        sampler = DistributedSampler(data_loader.dataset, shuffle=shuffle)
        loader = DataLoader(
            data_loader.dataset, batch_size=data_loader.batch_size, sampler=sampler,
            num_workers=data_loader.num_workers, collate_fn=data_loader.collate_fn,
            pin_memory=data_loader.pin_memory, drop_last=data_loader.drop_last,
        )
    if not move_to_device:
        return loader
    return _DeviceLoader(loader, get_device())


class _DeviceLoader:
    def __init__(self, loader, device) -> None:
        self.loader = loader
        self.device = device
        self.sampler = getattr(loader, "sampler", None)

    def __getattr__(self, name: str):
        # Everything else a DataLoader has (dataset, batch_size, num_workers, ...) is the wrapped loader's.
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield _to_device(batch, self.device)


def _to_device(batch, device):
    if hasattr(batch, "to"):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch
