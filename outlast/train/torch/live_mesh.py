"""An FSDP2 (HSDP) device mesh whose process groups outlive the death of a rank, for live recovery.

    mesh = outlast.train.torch.live_mesh(shards=2)       # replicas of 2 ranks: each shard held once per replica
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    live = LiveTraining(model, torch.optim.AdamW(model.parameters()), mesh=mesh)

FSDP2 keeps the process groups of the mesh it was given for the model's life. So the groups it keeps here are
`LiveProcessGroup`s, which stay while each generation of the live group gives them a gloo group of its own
(`LiveMesh.attach`) and takes it away when a rank is lost (`LiveMesh.close`). Taking it away is what makes a peer
fail fast: gloo's `abort()` stops nothing that is blocked, and a peer waiting on this rank (not on the lost one)
raises only once this rank's sockets close, which they do when its gloo group is freed. A `ProcessGroup` of
torch's own would not do: it keeps the first backend registered for a device, so the group of the generation that
broke would live on in it.

Collectives that FSDP2 issues through `torch.distributed`'s functions reach the `LiveProcessGroup`'s methods. Those
that DTensor issues as functional collectives (`clip_grad_norm_` over sharded parameters, `full_tensor()`) find
their group by its name in c10d's registry and need a backend in it: each generation registers, under each group's
name, a plain `ProcessGroup` around the same gloo group, after FSDP2 took the `LiveProcessGroup` for its own.

This module is the one place that writes into c10d's private tables (`_world`, the registry of names): torch's
`DeviceMesh.from_group` reads them, and has no public way to be given a group it did not make.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from outlast.faults import fault_point
from outlast.train.live.group import GroupBroken, await_members

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.device_mesh import DeviceMesh

PEER_LOSS_MARKS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer")


def is_peer_loss(error: BaseException) -> bool:
    """Whether an error raised out of a forward or backward is a collective that failed because a peer is gone
    (the step is void, the rank lives on), not the loop's own error. gloo's transport errors are RuntimeErrors whose
    text names the transport; a collective of a group already closed raises GroupBroken."""
    if isinstance(error, GroupBroken):
        return True
    return isinstance(error, RuntimeError) and any(mark in str(error) for mark in PEER_LOSS_MARKS)


def _process_group_classes() -> tuple[type, type]:
    """`LiveProcessGroup` and its work, made when first asked: torch.distributed is imported by the ranks that use
    the mesh alone."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    import torch.distributed as dist

    class LiveWork(dist.Work):
        """A generation's work, which closes its group the moment it fails: the peers waiting on this rank then fail
        as well, before the error has gone up through FSDP and autograd (whose frames hold the work until then)."""

        def __init__(self, group: Any, inner: Any) -> None:
            super().__init__()
            self.group, self.inner = group, inner

        def wait(self, timeout: Any = None) -> bool:
            if self.group.inner is None:
                # Its group closed since (another collective failed): the step is void and nothing of this work is
                # used, so nothing waits on it (FSDP's reset after the failure waits on what was in flight).
                return True
            try:
                return bool(self.inner.wait())
            except RuntimeError as e:
                why = str(e)
            self.inner = None
            self.group.close()
            raise GroupBroken(f"{self.group.name}: {why}")

        def is_completed(self) -> bool:
            return self.inner is None or bool(self.inner.is_completed())

        def get_future(self) -> Any:
            if self.inner is None:
                raise GroupBroken(f"{self.group.name}: closed")
            return self.inner.get_future()

    class LiveProcessGroup(dist.ProcessGroup):
        """One group of the mesh (a replica's shard group, or a shard's replicate group), the same object across
        generations; each generation's gloo group does its collectives."""

        def __init__(self, name: str, rank: int, size: int) -> None:
            super().__init__(rank, size)
            self.name = name
            self.inner: Any = None
            self.closed_since_attach = False  # a collective failed in this generation: its step is void

        @property
        def group_name(self) -> str:  # type: ignore[override]
            return self.name

        @property
        def group_desc(self) -> str:  # type: ignore[override]
            return self.name

        def getBackendName(self) -> str:  # noqa: N802 (torch's name)
            return "gloo"

        def close(self) -> None:
            if self.inner is not None:
                self.closed_since_attach = True
            self.inner = None

        def attach(self, inner: Any) -> None:
            self.inner, self.closed_since_attach = inner, False

        def _open(self) -> Any:
            if self.inner is None:
                raise GroupBroken(f"{self.name}: no group of this generation (a collective of it failed, or the "
                                  "group has not formed yet)")
            return self.inner

        def _work(self, inner: Any) -> Any:
            return LiveWork(self, inner)

        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            g = self._open()
            return self._work(g.allreduce(tensors) if opts is None else g.allreduce(tensors, opts))

        def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            g = self._open()
            return self._work(g.allgather(outputs, inputs) if opts is None else g.allgather(outputs, inputs, opts))

        def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:
            g = self._open()
            return self._work(g._allgather_base(output, input) if opts is None else
                              g._allgather_base(output, input, opts))

        all_gather_single = _allgather_base

        def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            return self._work(self._open().reduce_scatter(outputs, inputs, opts))

        def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:
            return self._work(self._open()._reduce_scatter_base(output, input, opts))

        reduce_scatter_single = _reduce_scatter_base

        def broadcast(self, tensors: Any, opts: Any = None) -> Any:
            g = self._open()
            return self._work(g.broadcast(tensors) if opts is None else g.broadcast(tensors, opts))

        def barrier(self, opts: Any = None) -> Any:
            return self._work(self._open().barrier())

    _CLASSES = (LiveProcessGroup, LiveWork)
    return _CLASSES


_CLASSES: tuple[type, type] | None = None


@dataclass
class LiveMesh:
    """The mesh's groups on this rank, and the plain groups registered under their names for this generation."""

    replicas: int
    shards: int
    rank: int
    world: Any  # the default group: DeviceMesh asks it for the rank; nothing reduces over it
    groups: dict[str, tuple[Any, list[int]]]  # name: (LiveProcessGroup, the global ranks in it)
    registered: dict[str, Any] = field(default_factory=dict)

    @property
    def shard(self) -> int:
        return self.rank % self.shards

    def broke(self) -> bool:
        """Whether a collective of this generation's groups failed (its group closed): the step in flight is void,
        whether or not the error reached the loop."""
        return any(group.closed_since_attach for group, _ in self.groups.values())

    def attach(self, store: Store, generation: int, rank: int, world_size: int, timeout_s: float) -> None:
        """Form this generation's gloo groups (every member of the generation does, at the same point). Raises
        GroupBroken when one cannot form (a member lost meanwhile)."""
        import torch
        import torch.distributed as dist

        if (rank, world_size) != (self.rank, self.replicas * self.shards):
            raise RuntimeError(f"this rank's mesh was made at rank {self.rank} of {self.replicas * self.shards}, and "
                               f"generation {generation} numbers it {rank} of {world_size}: an FSDP2 mesh keeps its "
                               "shape and its ranks (the controller, told so, resizes such a run only by a restart)")
        self.close()
        fault_point("live.attach")  # the others wait for this rank's groups of the generation
        timeout = timedelta(seconds=timeout_s)
        for name, (group, ranks) in self.groups.items():
            where = f"live/g{generation}/mesh/{name}/"
            prefixed = dist.PrefixStore(where + "pg", store)
            try:
                # In the store first, as LiveGroup.form: a member lost meanwhile is seen there, not at gloo's timeout.
                await_members(store, where, generation, ranks.index(rank), len(ranks), timeout_s)
                inner = dist.ProcessGroupGloo(prefixed, ranks.index(rank), len(ranks), timeout)
            except GroupBroken:
                self.close()
                raise
            except RuntimeError as e:
                self.close()
                raise GroupBroken(f"generation {generation}: rank {rank} could not form its group {name}: {e}") from e
            group.attach(inner)
            plain = dist.ProcessGroup(prefixed, ranks.index(rank), len(ranks))
            plain._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, inner)
            _register(plain, name, ranks, store, replace=True)
            self.registered[name] = plain

    def close(self) -> None:
        """Free this generation's gloo groups: their sockets close, and a peer blocked on this rank fails now."""
        from torch.distributed import distributed_c10d as c10d

        for name, (group, _) in self.groups.items():
            group.close()
            plain = self.registered.pop(name, None)
            if plain is not None:
                _unregister(plain, name)
                c10d._register_process_group(name, group)  # the name back to the group that outlives generations


def _register(group: Any, name: str, ranks: list[int], store: Store, replace: bool = False) -> None:
    from torch.distributed import distributed_c10d as c10d

    if replace:
        c10d._unregister_process_group(name)
    c10d._register_process_group(name, group)
    c10d._world.pg_map[group] = ("gloo", store)
    c10d._world.pg_names[group] = name
    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(ranks)}
    c10d._world.pg_backend_config[group] = "cpu:gloo"


def _unregister(group: Any, name: str) -> None:
    from torch.distributed import distributed_c10d as c10d

    c10d._unregister_process_group(name)
    for table in (c10d._world.pg_map, c10d._world.pg_names, c10d._world.pg_group_ranks,
                  c10d._world.pg_backend_config):
        table.pop(group, None)


def make_mesh(rank: int, world_size: int, shards: int, store: Store) -> tuple[DeviceMesh, LiveMesh]:
    """The (replicate, shard) mesh of `world_size // shards` replicas of `shards` ranks each, as FSDP2's HSDP takes
    it: rank r holds shard r % shards in replica r // shards. Its groups have no gloo group until `attach`."""
    import torch
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh

    if shards < 1 or world_size % shards:
        raise ValueError(f"live_mesh(shards={shards}): the world's {world_size} ranks must be a whole number of "
                         f"replicas of {shards} ranks each (shards between 1 and the world size, dividing it)")
    group_class = _process_group_classes()[0]
    if c10d.is_initialized() and not isinstance(c10d._get_default_group(), group_class):
        raise RuntimeError("live_mesh() with a default process group already made: live recovery forms its groups "
                           "itself, once per generation; do not call init_process_group in this mode")
    replicas = world_size // shards
    replica, shard = divmod(rank, shards)
    world = group_class("live-world", rank, world_size)
    _register(world, "live-world", list(range(world_size)), store)
    c10d._update_default_pg(world)
    # The mesh's two dimensions: this shard's holders across the replicas, and this replica's ranks (its shards).
    across, along = f"live-replicas-of-shard{shard}", f"live-shards-of-replica{replica}"
    groups = {along: (group_class(along, shard, shards), [replica * shards + s for s in range(shards)]),
              across: (group_class(across, replica, replicas), [r * shards + shard for r in range(replicas)])}
    for name, (group, ranks) in groups.items():
        _register(group, name, ranks, store)
    live = LiveMesh(replicas, shards, rank, world, groups)
    mesh = DeviceMesh.from_group([groups[across][0], groups[along][0]], "cpu",
                                 mesh=torch.arange(world_size).view(replicas, shards),
                                 mesh_dim_names=("replicate", "shard"))
    mesh._outlast_live = live  # type: ignore[attr-defined]  # LiveTraining(mesh=...) finds its groups here
    return mesh, live


def live_of(mesh: Any) -> LiveMesh:
    live = getattr(mesh, "_outlast_live", None)
    if live is None:
        raise TypeError("LiveTraining(mesh=...) takes the mesh live_mesh() made (its groups outlive a rank's death); "
                        f"got {type(mesh).__name__}")
    return live
