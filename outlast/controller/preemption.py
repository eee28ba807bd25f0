"""The preemption answer without a barrier: horizons granted to each rank.

Each worker counts its `get_preemption_info()` calls. Calls below its horizon H return
None locally, with no message. At H it asks; while no preemption is pending the
controller grants a new horizon sized from that rank's call rate, so that a notice
reaches the training loop within about `target_latency_s`. Once a preemption is
pending it stops extending and fixes the decision index D to the highest horizon it
ever granted: every rank returns None before call D and the notice from call D on.
So all ranks see the notice on the same call, and no rank waits for another.
Pure: time comes in as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Grant:
    horizon: int  # calls with index < horizon may return None without asking


@dataclass(frozen=True)
class Decision:
    decision_index: int  # calls with index >= decision_index return the notice


@dataclass
class _RankRate:
    last_index: int = -1
    last_time: float = 0.0
    rate: float = 0.0  # calls per second, smoothed


@dataclass
class HorizonBook:
    target_latency_s: float = 0.25
    max_step: int = 1 << 20
    granted_max: int = 0
    decision_index: int | None = None
    _rates: dict[int, _RankRate] = field(default_factory=dict)

    def on_query(self, rank: int, index: int, now: float) -> Grant | Decision:
        """Rank `rank` reached call `index` (its horizon): extend it, or answer with the decision."""
        if self.decision_index is not None:
            return Decision(self.decision_index)
        step = self._step(rank, index, now)
        horizon = index + step
        self.granted_max = max(self.granted_max, horizon)
        return Grant(horizon)

    def preempt(self) -> int:
        """A notice arrived: stop extending. Returns D, the first call that reports it."""
        if self.decision_index is None:
            self.decision_index = self.granted_max
        return self.decision_index

    def _step(self, rank: int, index: int, now: float) -> int:
        r = self._rates.setdefault(rank, _RankRate())
        if r.last_index >= 0 and now > r.last_time and index > r.last_index:
            observed = (index - r.last_index) / (now - r.last_time)
            r.rate = observed if r.rate == 0.0 else 0.5 * r.rate + 0.5 * observed
        r.last_index, r.last_time = index, now
        if r.rate == 0.0:
            return 1  # no rate yet: ask again on the next call
        return max(1, min(self.max_step, int(r.rate * self.target_latency_s)))
