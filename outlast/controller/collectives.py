"""Barrier and broadcast across ranks, tracked as data with time as an argument."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PendingCollective:
    seq: int
    op: str
    started_at: float
    arrived: set[int] = field(default_factory=set)
    payload: bytes | None = None
    warned_at: float | None = None


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
        self._pending: dict[int, PendingCollective] = {}

    def arrive(self, rank: int, seq: int, op: str, payload: bytes | None, now: float) -> PendingCollective | None:
        """Record `rank` entering collective `seq`; return it once every rank has arrived."""
        pending = self._pending.get(seq)
        if pending is None:
            pending = self._pending[seq] = PendingCollective(seq, op, now)
        if pending.op != op:
            raise ValueError(
                f"collective #{seq}: rank {rank} called {op} while other ranks called {pending.op}; "
                "every rank must call the same collectives in the same order"
            )
        pending.arrived.add(rank)
        if rank == 0:
            pending.payload = payload
        if len(pending.arrived) == self.world_size:
            return self._pending.pop(seq)
        return None

    def overdue(self, now: float) -> list[Overdue]:
        """Collectives to warn about (at most once per warning interval) or to fail."""
        out = []
        for p in list(self._pending.values()):
            waited = now - p.started_at
            missing = sorted(set(range(self.world_size)) - p.arrived)
            if waited >= self.timeout_s:
                del self._pending[p.seq]
                out.append(Overdue(p.seq, p.op, missing, sorted(p.arrived), waited, timed_out=True))
            elif waited >= self.warn_after_s and (p.warned_at is None or now - p.warned_at >= self.warn_after_s):
                p.warned_at = now
                out.append(Overdue(p.seq, p.op, missing, sorted(p.arrived), waited, timed_out=False))
        return out
