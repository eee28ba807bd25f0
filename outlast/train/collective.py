"""Collectives across the ranks of a run, through the controller (no torch needed)."""

from __future__ import annotations

from typing import TypeVar

from outlast.train._session import get_session

T = TypeVar("T")


def barrier() -> None:
    """Wait until every rank has called `barrier()`."""
    get_session("collective.barrier").collective("barrier")


def broadcast_from_rank_zero(data: T = None) -> T:
    """Return rank 0's `data` on every rank (it must be picklable)."""
    return get_session("collective.broadcast_from_rank_zero").collective("broadcast", data)


def allgather(data: T) -> dict[int, T]:
    """Every rank's `data` (picklable), by rank, on every rank. outlast's own (Ray Train has no allgather):
    what a framework's set-up needs from each rank, such as the address it listens on. A rank lost under
    `relax_collectives_on_preemption` is missing from the answer."""
    return get_session("collective.allgather").collective("allgather", data)
