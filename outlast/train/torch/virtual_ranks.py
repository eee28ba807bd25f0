"""`virtual_rank_gradients`: a step's gradients that come out the same, bit for bit, at any world size.

An all-reduce sums the ranks' gradients in an order set by the world size (and, in gloo's ring, by an
element's place in the tensor), and a per-rank batch of fixed size makes the global batch follow the world
size too, so a run that loses a node and goes on at 2 ranks of 3 ends with other weights than one that did
not. With `DataConfig(virtual_ranks=V)` a step's rows are the same at any world size: V batches, one per
virtual rank, each rank holding some of them. This takes the gradient of each virtual rank's batch alone
(its own backward, so that no kernel sums rows of two of them together), places it in the row of a V-row
buffer that is that virtual rank's, all-reduces the buffer (every row is nonzero on one rank only, and
adding zeros is exact, so each row arrives as it was computed) and sums the rows in virtual rank order.

The cost: one backward per virtual rank held, and an all-reduce of V gradients' bytes instead of one.
It is for runs whose weights must not depend on the world size (a study that is resized and must compare
bit for bit with one that was not), not for bandwidth.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any


def virtual_rank_gradients(model: Any, batches: Any, loss_fn: Callable[[Any], Any]) -> list[Any]:
    """Run `loss_fn(batch)` and its backward for each batch of `batches` (one step's `VirtualBatches` from
    `get_dataset_shard` with `DataConfig(virtual_ranks=...)`), then leave in each trainable parameter's
    `.grad` the mean of every virtual rank's gradient in the run, the same at any world size. Returns the
    losses of this rank's batches, detached. `model` may be a `prepare_model` DDP module: its own all-reduce
    is skipped (`no_sync`), this one takes its place."""
    import torch
    import torch.distributed as dist

    virtual_ranks, virtual_world = _virtual(batches)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("virtual_rank_gradients: the model has no parameter that requires a gradient")
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"virtual_rank_gradients: the model's trainable parameters have dtypes {sorted(map(str, dtypes))}; "
                         "it reduces one flat buffer of one dtype: cast the model to one (model.to(dtype))")
    sizes = [p.numel() for p in params]
    grads = torch.zeros(virtual_world, sum(sizes), dtype=params[0].dtype, device=params[0].device)
    no_sync = model.no_sync if hasattr(model, "no_sync") else contextlib.nullcontext
    losses = []
    for v, batch in zip(virtual_ranks, batches):
        for p in params:
            p.grad = None
        with no_sync():
            loss = loss_fn(batch)
            loss.backward()
        losses.append(loss.detach())
        torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params], out=grads[v])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(grads)
    mean = grads[0].clone()
    for v in range(1, virtual_world):  # one order at every world size: virtual rank 0, 1, 2, ...
        mean += grads[v]
    mean /= virtual_world
    offset = 0
    for p, n in zip(params, sizes):
        p.grad = mean[offset:offset + n].view_as(p)
        offset += n
    return losses


def _virtual(batches: Any) -> tuple[tuple[int, ...], int]:
    virtual_ranks = getattr(batches, "virtual_ranks", None)
    virtual_world = getattr(batches, "virtual_world", None)
    if virtual_ranks is None or virtual_world is None:
        raise TypeError(f"virtual_rank_gradients needs one step's batches of a dataset split into virtual ranks "
                        f"(TorchTrainer(..., dataset_config=DataConfig(virtual_ranks=V)), then "
                        f"get_dataset_shard(...).iter_torch_batches(...)), got a {type(batches).__name__}")
    if len(virtual_ranks) != len(batches):
        raise ValueError(f"virtual_rank_gradients: {len(batches)} batches for virtual ranks {list(virtual_ranks)}")
    return tuple(virtual_ranks), int(virtual_world)
