"""One gradient bucket layout for every iteration of a DistributedDataParallel model, in every process group.

DDP reduces its first iteration in the constructor's layout (every parameter in one bucket, in
definition order) and rebuilds the buckets once, before the second, in the order the first
backward made gradients ready (`should_rebuild_buckets` in torch's reducer.hpp). An allreduce sums
each element in an order that depends on where the element lies in its bucket (gloo's ring starts
each chunk at another rank). With two ranks a + b = b + a; from three on, the two layouts give
different last bits. A run restored from a checkpoint starts a new process group, and so a new
first iteration, at a step where the run without the restart used the rebuilt layout: its weights
drift from that run's in the last bits, and further with every step.

`fix_bucket_layout` runs one backward of zeros through the model before any real one, so the buckets
are rebuilt, before the first real iteration, in an order that depends only on the model: every
real iteration of every process group reduces in that one layout, at no cost per step.
"""

from __future__ import annotations

from typing import Any

# DDP settings under which the backward of zeros would change what DDP does, or is not needed:
# static_graph records its graph in the first iteration, find_unused_parameters never rebuilds.
_LEFT_ALONE = ("static_graph", "find_unused_parameters", "mixed_precision", "delay_all_reduce_named_params")


def _sparse(module) -> bool:
    import torch

    return any(isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse for m in module.modules())


def can_fix_bucket_layout(module, ddp_kwargs: dict[str, Any]) -> bool:
    """Whether `fix_bucket_layout` applies to `module` wrapped with `ddp_kwargs`: not for settings that give the first
    iteration a meaning of its own, nor for sparse gradients (a backward of zeros is dense)."""
    return not any(ddp_kwargs.get(name) for name in _LEFT_ALONE) and not _sparse(module)


def fix_bucket_layout(ddp) -> None:
    """Rebuild `ddp`'s buckets in the order a backward of zeros makes gradients ready: the last parameter defined
    first, as DDP itself assumes before it has seen a backward. Collective: every rank calls it, once, right after
    constructing `ddp`. The parameters' values, buffers and optimizer are untouched, and their `.grad` left None."""
    import torch

    params = [p for p in ddp.module.parameters() if p.requires_grad]
    if not params:
        return

    class EveryParameter(torch.nn.Module):
        """A zero that depends on each parameter, its terms created in definition order so that the backward
        reaches the last parameter first."""

        def forward(self, _unused):
            return torch.stack([p.sum() for p in params]).mul(0).sum()

    original, buffers = ddp.module, ddp.modules_buffers
    # DDP's forward calls `self.module`: a stand-in that reads every parameter, so that none of the model's own
    # forward, hooks or buffers run. Without buffers DDP does not broadcast them before this forward (it did at its
    # construction). The one input is there for DDP to move to the device as it would a batch.
    ddp.module, ddp.modules_buffers = EveryParameter(), []
    try:
        ddp(torch.zeros((), device=params[0].device)).backward()
    finally:
        ddp.module, ddp.modules_buffers = original, buffers
    for p in params:
        p.grad = None
