"""How long the checkpoint uploads still in flight will take: bytes left over measured bandwidth.

Pure: fed with what reports say (each rank's checkpoint bytes and the bandwidth its
previous upload achieved) and the time, it answers with seconds and a reason. Ranks
upload in parallel, so the answer is the slowest rank's. A preemption decision uses it
to tell whether a just-in-time checkpoint will be in before the node goes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Estimate:
    seconds: float | None  # None: cannot tell (a rank has not measured its bandwidth yet)
    bytes_left: int
    reason: str


@dataclass
class _Upload:
    started: float
    nbytes: int
    bandwidth_bps: float


@dataclass
class UploadEstimate:
    _pending: dict[tuple[int, int], _Upload] = field(default_factory=dict)  # (rank, report index) ->
    _done_early: set[tuple[int, int]] = field(default_factory=set)  # UploadDone came before its Report

    def on_report(self, rank: int, index: int, nbytes: int, bandwidth_bps: float, now: float) -> None:
        """A report whose upload is still to come (ASYNC or a staged save)."""
        if (rank, index) in self._done_early:  # its UploadDone overtook it: nothing is in flight
            self._done_early.discard((rank, index))
            return
        self._pending[(rank, index)] = _Upload(now, nbytes, bandwidth_bps)

    def on_upload_done(self, rank: int, index: int) -> None:
        if self._pending.pop((rank, index), None) is None:
            self._done_early.add((rank, index))

    def clear(self) -> None:
        """A new attempt: the old attempt's uploads died with its workers."""
        self._pending.clear()
        self._done_early.clear()

    def estimate(self, now: float, only: Callable[[int, int], bool] | None = None) -> Estimate:
        """`only(rank, index)`: count just those uploads (a notice's checkpoint goes before the others)."""
        pending = {k: up for k, up in self._pending.items() if only is None or only(*k)}
        if not pending:
            return Estimate(0.0, 0, "no upload in flight")
        # rank -> (seconds left, bytes left): one rank's uploads go one after another
        per_rank: dict[int, tuple[float, int]] = {}
        unknown = []
        for (rank, index), up in sorted(pending.items()):
            if up.bandwidth_bps <= 0:
                unknown.append(f"rank {rank} (report #{index}) has not measured an upload yet")
                left_bytes = up.nbytes
                seconds = 0.0
            else:
                done = (now - up.started) * up.bandwidth_bps
                left_bytes = max(int(up.nbytes - done), 0)
                seconds = left_bytes / up.bandwidth_bps
            s, b = per_rank.get(rank, (0.0, 0))
            per_rank[rank] = (s + seconds, b + left_bytes)
        bytes_left = sum(b for _, b in per_rank.values())
        if unknown:
            return Estimate(None, bytes_left, "; ".join(unknown))
        rank, (seconds, left) = max(per_rank.items(), key=lambda kv: kv[1][0])
        return Estimate(seconds, bytes_left,
                        f"{bytes_left / 1e6:.1f} MB left; rank {rank} is the slowest, {left / 1e6:.1f} MB at "
                        f"{min(up.bandwidth_bps for (r, _), up in pending.items() if r == rank) / 1e6:.1f} MB/s")
