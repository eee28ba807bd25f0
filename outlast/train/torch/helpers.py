"""The usual helpers of a DDP training loop, called inside workers."""

from __future__ import annotations

import os
from typing import Any

from outlast.train._session import get_session
from outlast.train.torch.ddp_layout import can_fix_bucket_layout, fix_bucket_layout
from outlast.train.torch.live import STORE_VAR
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
    """Give each rank its own shard of `data_loader` and move batches to the device.

    A loader over a map-style dataset with a batch size and its default sampler (in order, or shuffled) is
    read through `EpochBatches`: each rank's share of every epoch, as a DistributedSampler gives it, with
    the loader's place kept in every checkpoint, so that a restored run goes on at the next batch of the
    epoch (docs/guide/training.md). Any other loader keeps its own sampler (a DistributedSampler is added
    to a loader without one, as before) and its epochs start over on a restore.

    The result reads like the DataLoader it wraps (`.dataset`, `.batch_size`, `.sampler`, `len()`).
    `auto_transfer` (copying the next batch to the GPU on a side stream) is accepted and ignored:
    batches move to the device as they are read.
    """
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

    from outlast.train import positions
    from outlast.train.torch.epoch_batches import EpochBatches

    loader = data_loader
    batches = None
    live = bool(os.environ.get(STORE_VAR))
    if live:
        # Live recovery forms no default group: the ranks are the run's, and a replacement takes its loader's
        # place from a survivor (LiveTraining), which only the batches below keep.
        ctx = get_session("prepare_data_loader").context
        world, rank = ctx.world_size, ctx.world_rank
    else:
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    if add_dist_sampler and type(data_loader.sampler) in (SequentialSampler, RandomSampler) and \
            data_loader.batch_size is not None and hasattr(data_loader.dataset, "__len__"):
        batches = EpochBatches(len(data_loader.dataset), rank, world, data_loader.batch_size,
                               shuffle=isinstance(data_loader.sampler, RandomSampler),
                               drop_last=data_loader.drop_last)
        positions.track_for("loader", data_loader.dataset, batches)
        loader = DataLoader(
            data_loader.dataset, batch_sampler=batches, num_workers=data_loader.num_workers,
            collate_fn=data_loader.collate_fn, pin_memory=data_loader.pin_memory,
            worker_init_fn=data_loader.worker_init_fn, persistent_workers=data_loader.persistent_workers,
            **({"prefetch_factor": data_loader.prefetch_factor} if data_loader.num_workers else {}),
        )
    elif live:
        raise RuntimeError("prepare_data_loader with FailureConfig(live_recovery=True) takes a DataLoader over a "
                           "dataset with a length, a batch_size and its default sampler (shuffle=True or False), "
                           "whose place a replacement rank takes up; this one has "
                           f"{type(data_loader.sampler).__name__}. Use such a DataLoader, or draw each step's batch "
                           "from the step number and train.get_context().get_world_rank() "
                           "(docs/guide/live-recovery.md)")
    elif add_dist_sampler and world > 1 and not isinstance(data_loader.sampler, DistributedSampler):
        shuffle = not isinstance(data_loader.sampler, SequentialSampler)
        sampler = DistributedSampler(data_loader.dataset, shuffle=shuffle)
        loader = DataLoader(
            data_loader.dataset, batch_size=data_loader.batch_size, sampler=sampler,
            num_workers=data_loader.num_workers, collate_fn=data_loader.collate_fn,
            pin_memory=data_loader.pin_memory, drop_last=data_loader.drop_last,
        )
    if not move_to_device and batches is None:
        return loader
    return _DeviceLoader(loader, get_device() if move_to_device else None, batches)


class _DeviceLoader:
    """The loader prepare_data_loader returns: batches moved to the device, and counted as the loop takes them."""

    def __init__(self, loader, device, batches=None) -> None:
        self.loader = loader
        self.device = device
        self.batches = batches
        # Ray's examples call `loader.sampler.set_epoch(epoch)`: EpochBatches answers it as a DistributedSampler.
        self.sampler = batches if batches is not None else getattr(loader, "sampler", None)
        if batches is not None:  # the DataLoader under it has a batch sampler, so its own say None and False
            self.batch_size, self.drop_last = batches.batch_size, batches.drop_last

    def __getattr__(self, name: str):
        # Everything else a DataLoader has (dataset, batch_size, num_workers, ...) is the wrapped loader's.
        if name in ("loader", "batches"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        try:
            for batch in self.loader:
                if self.batches is not None:
                    self.batches.handed_out()  # before the loop has it: a checkpoint in the loop body has used it
                yield _to_device(batch, self.device) if self.device is not None else batch
        finally:
            if self.batches is not None:
                self.batches.walk_ended()


def _to_device(batch, device):
    if hasattr(batch, "to"):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch
