"""Barrier, broadcast and allgather across ranks, tracked as data with time as an argument.

An allgather's reply is every surviving rank's payload, by rank (`gathered_payload`), encoded
without being read: the controller never unpickles what ranks send.

With `relax_collectives_on_preemption` the runtime calls `lose_ranks` for the ranks of a
lost node: a collective then completes once every surviving rank has arrived, and later
arrivals of lost ranks are ignored. A broadcast's source is rank 0; once rank 0 is lost
before arriving, the lowest surviving rank that arrived with a payload takes its place,
which is why in relaxed mode every rank sends its payload.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from outlast.protocol.messages import ALLGATHER, gathered_payload


@dataclass
class PendingCollective:
    seq: int
    op: str
    started_at: float
    arrived: set[int] = field(default_factory=set)
    payload: bytes | None = None  # the source's payload; final once the collective is returned complete
    warned_at: float | None = None
    # rank -> payload. Every candidate source is kept because whichever is lowest may be lost later.
    payloads: dict[int, bytes | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Overdue:
    seq: int
    op: str
    missing: list[int]
    arrived: list[int]
    waited_s: float
    timed_out: bool  # False: only worth a warning


class CollectiveTracker:
    def __init__(self, world_size: int, warn_after_s: float, timeout_s: float) -> None:
        self.world_size = world_size
        self.warn_after_s = warn_after_s
        self.timeout_s = timeout_s
        self.lost: set[int] = set()
        self._pending: dict[int, PendingCollective] = {}

    def grow(self, world_size: int) -> None:
        """Live recovery: ranks added to the attempt are waited for from the next collective on."""
        self.world_size = max(self.world_size, world_size)

    def arrive(self, rank: int, seq: int, op: str, payload: bytes | None, now: float) -> PendingCollective | None:
        """Record `rank` entering collective `seq`; return it once every surviving rank has arrived."""
        if rank in self.lost:
            return None  # a straggler: the others no longer wait for it
        pending = self._pending.get(seq)
        if pending is None:
            pending = self._pending[seq] = PendingCollective(seq, op, now)
        if pending.op != op:
            raise ValueError(
                f"collective #{seq}: rank {rank} called {op} while other ranks called {pending.op}; "
                "every rank must call the same collectives in the same order"
            )
        pending.arrived.add(rank)
        if rank == 0 or payload is not None:
            pending.payloads[rank] = payload
        if op != ALLGATHER:
            pending.payload = self._source_payload(pending)
        if self._survivors() <= pending.arrived:
            return self._complete(self._pending.pop(seq))
        return None

    def lose_ranks(self, ranks: Iterable[int]) -> list[PendingCollective]:
        """Stop waiting for `ranks`; return the collectives that completed because of it, by sequence number."""
        self.lost |= set(ranks)
        survivors = self._survivors()
        out = []
        for seq in sorted(self._pending):
            pending = self._pending[seq]
            if survivors <= pending.arrived:
                pending.payload = self._source_payload(pending)
                out.append(self._complete(self._pending.pop(seq)))
        return out

    def _complete(self, pending: PendingCollective) -> PendingCollective:
        if pending.op == ALLGATHER:
            pending.payload = gathered_payload({r: p for r, p in pending.payloads.items()
                                                if r not in self.lost and p is not None})
        return pending

    def overdue(self, now: float) -> list[Overdue]:
        """Collectives to warn about (at most once per warning interval) or to fail."""
        if not self._pending:  # the controller asks at every step
            return []
        out = []
        for p in list(self._pending.values()):
            waited = now - p.started_at
            missing = sorted(self._survivors() - p.arrived)
            if waited >= self.timeout_s:
                del self._pending[p.seq]
                out.append(Overdue(p.seq, p.op, missing, sorted(p.arrived), waited, timed_out=True))
            elif waited >= self.warn_after_s and (p.warned_at is None or now - p.warned_at >= self.warn_after_s):
                p.warned_at = now
                out.append(Overdue(p.seq, p.op, missing, sorted(p.arrived), waited, timed_out=False))
        return out

    def _survivors(self) -> set[int]:
        return set(range(self.world_size)) - self.lost

    def _source_payload(self, pending: PendingCollective) -> bytes | None:
        # Rank 0's word stands once spoken, even if its node is lost afterwards; only a rank 0
        # lost before arriving hands the source over to the lowest surviving rank.
        if 0 in pending.payloads:
            return pending.payloads[0]
        if 0 not in self.lost:
            return None
        return next((pending.payloads[r] for r in sorted(pending.payloads) if r not in self.lost), None)
