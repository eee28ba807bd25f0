"""A gloo process group formed for one generation of a live group.

Each generation forms its own `ProcessGroupGloo` under a store prefix of its own, beside (never
through) torch.distributed's default group, so the group of a generation that lost a rank is
dropped and a new one formed while the process lives on. When a peer dies, its sockets close and
every collective pending with it raises at once (gloo reads "Connection reset by peer" or
"Connection closed by peer"), which `GroupBroken` carries. A peer that hangs is found only at
`timeout_s`, or when the controller, seeing it stop, publishes the next generation.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from outlast.protocol.membership import membership_key
from outlast.train.gloo_bind import device_toward, store_host

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroupGloo, Store


class GroupBroken(RuntimeError):
    """A collective of this generation's group failed: a peer is gone. The step in flight is void."""


def await_members(store: Store, where: str, generation: int, rank: int, world_size: int, timeout_s: float,
                  poll_s: float = 0.005) -> None:
    """Before a gloo group of `generation` is made under `where`: this rank says it is here, and waits until all
    `world_size` are, in the store, where it sees a newer generation published meanwhile (a member lost while the
    group formed). gloo's own rendezvous cannot be left before its timeout: waiting in it for a dead member cost the
    whole `timeout_s`. Raises GroupBroken."""
    import time

    store.set(f"{where}here/{rank}", "1")
    others = [f"{where}here/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(others):
        if store.check([membership_key(generation + 1)]):
            raise GroupBroken(f"generation {generation}: rank {rank} left it before it formed: generation "
                              f"{generation + 1} was published meanwhile")
        if time.monotonic() > deadline:
            raise GroupBroken(f"generation {generation}: rank {rank} could not form its group: not every rank "
                              f"came within {timeout_s} s")
        time.sleep(poll_s)


class LiveGroup:
    def __init__(self, pg: ProcessGroupGloo, generation: int, rank: int, world_size: int) -> None:
        self.pg: ProcessGroupGloo | None = pg
        self.generation = generation
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def form(cls, store: Store, generation: int, rank: int, world_size: int, timeout_s: float,
             poll_s: float = 0.005, name: str = "") -> LiveGroup:
        """Blocks until every rank of the generation has connected (or raises GroupBroken at `timeout_s`). `name`: a
        group of some of the generation's ranks, formed beside its whole group (`rank` and `world_size` within it).

        Every member first says it is here, in the store, and waits for the others there (`await_members`), where it
        can see a newer generation published meanwhile (a member died while this one formed: a replacement forked
        for two deaths a few milliseconds apart, say). Only then is gloo's group made."""
        import torch.distributed as dist

        where = f"live/g{generation}/{name}/" if name else f"live/g{generation}/"
        await_members(store, where, generation, rank, world_size, timeout_s, poll_s)
        prefixed, timeout = dist.PrefixStore(f"{where}pg", store), timedelta(seconds=timeout_s)
        # Each rank advertises the address it reaches the store by, which every other rank reaches too: gloo's own
        # choice, the hostname's address, is often 127.0.x.1 and out of reach of ranks on other nodes.
        device = device_toward(store_host(store))
        try:
            if device is None:
                pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            else:
                options = dist.ProcessGroupGloo._Options()
                options._devices, options._timeout = [device], timeout
                pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        except RuntimeError as e:
            raise GroupBroken(f"generation {generation}: rank {rank} could not form its group: {e}") from e
        return cls(pg, generation, rank, world_size)

    def _open(self) -> ProcessGroupGloo:
        if self.pg is None:
            raise GroupBroken(f"generation {self.generation}: rank {self.rank}'s group is closed (a collective of it "
                              "failed)")
        return self.pg

    def _run(self, what: str, work: Any) -> None:
        try:
            work.wait()
            return
        except RuntimeError as e:
            error = str(e)
        # Closed at once, with nothing of it left in this frame (which the GroupBroken's traceback keeps while the
        # caller handles it): a rank whose collective waits on this one, not on the lost rank, fails now too.
        del work
        self.close()
        raise GroupBroken(f"generation {self.generation}: rank {self.rank}'s {what} failed: {error}")

    def allreduce_sum(self, tensors: list[torch.Tensor]) -> None:
        self._run("allreduce", self._open().allreduce(tensors))

    def reduce_scatter_sum(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """`output` (of `input`'s length over the group's size): the sum over the ranks of this rank's piece of
        `input`, the pieces in rank order."""
        self._run("reduce-scatter", self._open()._reduce_scatter_base(output, input))

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (the same shape and dtype on each), in rank order."""
        import torch

        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._run("allgather", self._open().allgather([out], [tensor]))
        return out

    def allgather_int(self, value: int) -> list[int]:
        return [values[0] for values in self.allgather_ints([value])]

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (as many on each), in rank order: several numbers for the wait of one."""
        import torch

        return [t.tolist() for t in self.allgather(torch.tensor(values, dtype=torch.int64))]

    def send(self, tensor: torch.Tensor, to_rank: int, tag: int) -> None:
        self._run(f"send to rank {to_rank}", self._open().send([tensor], to_rank, tag))

    def recv(self, tensor: torch.Tensor, from_rank: int, tag: int) -> None:
        self._run(f"receive from rank {from_rank}", self._open().recv([tensor], from_rank, tag))

    def close(self) -> None:
        """Drop a generation's group, so that a peer still blocked in one of its collectives raises instead of
        waiting out its timeout. `abort` stops its work, and the group's sockets close only when the group itself
        goes (its last reference, which is this): a peer of four ranks that waited on this rank, not on the one
        lost, waited the whole timeout while this rank's process lived on."""
        if self.pg is None:
            return
        try:
            self.pg.abort()
        except RuntimeError:
            pass
        self.pg = None
