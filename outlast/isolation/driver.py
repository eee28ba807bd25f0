"""What the node's isolation (`node.NodeIsolation`) asks of a cgroup driver: `cgroup_v1.CgroupV1` and
`cgroup_v2.CgroupV2` are the two, and what each reads of memory is a `MemoryReading`."""

from __future__ import annotations

from typing import Protocol, TypedDict, runtime_checkable

from outlast.isolation.monitor import EventSource
from outlast.isolation.reservations import Reservations
from outlast.protocol.messages import Resources


class Unreadable(TypedDict):
    """memory.stat could not be read: why."""

    unreadable: str


class _ReadingExtras(TypedDict, total=False):
    kernel_oom_kills: int  # OOM kills of the kernel's in the node's cgroups so far
    unreadable: str  # set by the node on the reading it counts in place of one it could not read


class MemoryReading(_ReadingExtras):
    """One reading of the node's memory, in bytes."""

    limit: int | None  # the workloads' limit; None: no limit
    counted: int  # what the kill policy counts: the workloads' anonymous memory and the whole tree's shared memory
    user: int | None  # the workloads' cgroup's own usage (None: the file said "max")
    system: int | None  # the node's own processes'
    stalled: bool  # cgroup v1: the workloads are stopped at their limit, waiting for a kill


class CgroupDriver(Protocol):
    version: int  # the cgroup version it drives
    root: str  # the cgroup directory of the node's tree (of the memory hierarchy on v1)

    def validate(self) -> None: ...

    def starting_limit(self) -> int | None: ...

    def setup(self, res: Reservations) -> None: ...

    def teardown(self) -> list[str]: ...

    def cleanup_stale(self) -> list[str]: ...

    def create_leaf(self, name: str, resources: Resources) -> list[str]: ...

    def kill_leaf(self, name: str) -> None: ...

    def leaf_pids(self, name: str) -> list[int]: ...

    def remove_leaf(self, name: str) -> bool: ...

    def leaf_memory(self, name: str) -> int: ...

    def sample(self) -> MemoryReading | Unreadable: ...

    def monitors(self, limit: int | None, kill_at: float = 0.95) -> list[EventSource]: ...


@runtime_checkable
class HandsBackToKernel(Protocol):
    """A driver whose workloads stall at their limit for outlast to choose a victim (cgroup v1): with no
    outlast worker there to choose, it hands the choice back to the kernel's OOM killer."""

    def release_to_kernel(self) -> str | None: ...

    def hold_from_kernel(self) -> None: ...
