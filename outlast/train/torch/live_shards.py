"""The optimizer's state split between ranks, for live recovery (`LiveTraining(shards=S)`).

The ranks form replicas of S ranks each (the world is a multiple of S); rank r holds shard r % S. The model's
parameters become views into one flat tensor, cut into S equal shards (the last padded with zeros). Every rank
keeps every parameter (its forward and backward are those of data parallelism), but its optimizer is built over its
own shard alone, so the optimizer's state (momentum, Adam's moments) takes a 1/S part of what it took on each rank.
A step's gradients are reduced as HSDP reduces them (`reduce`): scattered within each replica, each rank summing
its shard's piece over the replica, then that piece summed across the replicas by the ranks holding the same
shard; once the step is committed each holder updates its shard, and an allgather within the replica gives every
rank the shards it does not hold (`gather`). Every collective is within a replica or across one shard's holders:
where a world of four holds two shards, collectives of two ranks moving half the bytes of an allreduce of every
gradient over the world and an allgather over it. The groups are formed for each generation beside its whole one
(`LiveTraining._join`); each rank sums in the same order in every generation.

What a rank holds for sure is its own shard, of the parameters and of the optimizer's state: a rank new to the group
takes its state from a holder of its shard, whose other shards may be a step behind when a death broke the gather;
every rank gathers once more each time the group forms, so no step runs on them. A shard whose every holder is lost
leaves nobody to send it: the run restarts from its newest checkpoint (`outlast.controller.live`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from outlast.train.live.group import LiveGroup


class FlatShards:
    def __init__(self, model: Any, make_optimizer: Callable[[list[torch.Tensor]], Any], rank: int, world_size: int,
                 shards: int) -> None:
        import torch

        if shards < 1 or world_size % shards:
            raise ValueError(f"LiveTraining(shards={shards}): the world's {world_size} ranks must be a whole number "
                             f"of replicas of {shards} ranks each (shards between 1 and the world size, dividing it)")
        if not callable(make_optimizer) or isinstance(make_optimizer, torch.optim.Optimizer):
            raise TypeError("LiveTraining(shards=...) builds the optimizer over this rank's shard: pass a function of "
                            "the parameters, such as functools.partial(torch.optim.AdamW, lr=1e-3), not an "
                            f"optimizer (got {type(make_optimizer).__name__})")
        self.params = [p for p in model.parameters()]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise TypeError(f"LiveTraining(shards=...) keeps the parameters as one flat tensor of one dtype; the model "
                            f"has {sorted(str(d) for d in dtypes) or 'no parameters'}")
        total = sum(p.numel() for p in self.params)
        self.shards, self.shard = shards, rank % shards
        self.size = -(-total // shards)  # every shard this long: the allgather takes equal pieces
        self.flat = torch.zeros(self.size * shards, dtype=dtypes.pop())
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self.flat[offset:offset + n].copy_(p.reshape(-1))
                p.data = self.flat[offset:offset + n].view_as(p)  # the model's parameters live in the flat tensor
                offset += n
        self.total = total
        self.own = torch.nn.Parameter(self._piece(self.shard))  # a view: the optimizer updates the flat tensor
        self.optimizer = make_optimizer([self.own])

    def _piece(self, shard: int) -> torch.Tensor:
        return self.flat[shard * self.size:(shard + 1) * self.size]

    def gradient(self) -> torch.Tensor:
        """This rank's gradients as one flat tensor the flat parameters' length (zeros where a parameter has none)."""
        import torch

        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype)
                 for p in self.params]
        return torch.cat(parts + [torch.zeros(self.flat.numel() - self.total, dtype=self.flat.dtype)])

    def reduce(self, gradient: torch.Tensor, replica: LiveGroup, holders: LiveGroup) -> torch.Tensor:
        """This rank's shard of `gradient` (`gradient()`, this rank's own) summed over every rank: scattered within
        its replica (`replica`, whose rank r holds shard r), then summed across the shard's holders (`holders`).
        `gradient` itself is left as it is: after a death the rank reduces it again in the next generation. Raises
        GroupBroken."""
        import torch

        piece = torch.empty(self.size, dtype=gradient.dtype)
        replica.reduce_scatter_sum(piece, gradient)
        holders.allreduce_sum([piece])
        return piece

    def apply(self, piece: torch.Tensor) -> None:
        """This rank's shard of a committed step's averaged gradients: its optimizer steps the shard."""
        self.own.grad = piece
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None

    def gather(self, replica: LiveGroup) -> None:
        """Every shard this rank does not hold, from its holder in this rank's replica (`replica`, whose rank r holds
        shard r; raises GroupBroken)."""
        import torch

        pieces = replica.allgather(self._piece(self.shard).detach().clone())
        with torch.no_grad():
            for shard in range(self.shards):
                if shard != self.shard:
                    self._piece(shard).copy_(pieces[shard])

    def state_dict(self) -> dict[str, Any]:
        return {"shard": self.shard, "shards": self.shards, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if (d["shard"], d["shards"]) != (self.shard, self.shards):
            raise ValueError(f"this rank holds shard {self.shard} of {self.shards}, and was sent the optimizer's "
                             f"state of shard {d['shard']} of {d['shards']}")
        self.optimizer.load_state_dict(d["optimizer"])


def reports_after_gather(own: int, counts: list[int], took_state: bool) -> int:
    """The count of reports a rank goes on from, after a gather in which every rank told its own (`counts`).

    A rank that took its state from a sender since its last step's gather adopts the highest: a rank lost in the
    gather after a committed step has the group form again before that step's report, so the sender's count may
    lack the report the others made since. The others keep their own: a rank that left that gather before the loss
    (its part went across) reported the step already, and one still to report it counts it when it does."""
    return max(counts) if took_state else own
