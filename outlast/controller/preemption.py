"""The preemption answer without a barrier: horizons granted to each rank.

Each worker counts its `get_preemption_info()` calls. A grant lets it answer None
locally, with no message, for calls below a horizon H and for `valid_s` seconds,
whichever ends first; then it asks again. So a notice reaches the training loop
within about `valid_s` whatever the loop's call rate, and a burst of calls (a
warm-up loop, a benchmark) cannot earn a grant that outlives the burst.

A notice fixes D, the first call that returns it, the same on every rank. A rank may
have answered None locally up to the horizon of its last grant, and no further; once
it asks again, its position is known exactly. So after a notice the book answers
each query with "ask again on the next call" (a hold) until every rank has asked
once, or `collect_s` has passed, and then fixes

    D = max over ranks of (the call it last asked at + 1, if it asked since the notice;
                            else the horizon of its last grant)

Every rank returns None before call D and the notice from D on, and no rank waits
for another: a lost rank (relaxed collectives) is simply not waited for.
Pure: time comes in as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Grant:
    horizon: int  # calls with index < horizon may return None without asking...
    valid_s: float  # ...for this long after the grant arrives


@dataclass(frozen=True)
class Decision:
    decision_index: int  # calls with index >= decision_index return the notice


@dataclass
class HorizonBook:
    valid_s: float = 0.25
    collect_s: float = 0.6  # a rank silent this long after a notice is bounded by its last grant
    max_step: int = 1 << 20
    decision_index: int | None = None
    noticed_at: float | None = None
    _outstanding: dict[int, int] = field(default_factory=dict)  # rank -> horizon of its last grant
    _asked: dict[int, int] = field(default_factory=dict)  # rank -> index it asked at since the notice
    _lost: set[int] = field(default_factory=set)

    def on_query(self, rank: int, index: int, now: float) -> Grant | Decision:
        """Rank `rank` reached call `index` (its horizon, or its grant expired): extend, hold, or decide."""
        if self.decision_index is not None:
            return Decision(self.decision_index)
        if self.noticed_at is None:
            horizon = index + self.max_step
            self._outstanding[rank] = horizon
            return Grant(horizon, self.valid_s)
        self._asked[rank] = index
        self._outstanding[rank] = index + 1
        if self._everyone_asked():
            return Decision(self._decide())
        return Grant(index + 1, float("inf"))  # a hold: ask again on the next call

    def preempt(self, now: float) -> int | None:
        """A notice arrived: stop extending. Returns D when it is already known (no rank has a grant)."""
        if self.noticed_at is None:
            self.noticed_at = now
        if self.decision_index is None and self._everyone_asked():
            self._decide()
        return self.decision_index

    def tick(self, now: float) -> int | None:
        """Fix D once the ranks that stay silent have had `collect_s` to ask; returns D when just fixed."""
        if self.decision_index is None and self.noticed_at is not None and now - self.noticed_at >= self.collect_s:
            return self._decide()
        return None

    @property
    def watched(self) -> bool:
        """Whether the loop asks get_preemption_info() at all (then it is waited for to save)."""
        return bool(self._outstanding)

    def lose_rank(self, rank: int) -> None:
        self._lost.add(rank)

    def _everyone_asked(self) -> bool:
        # A rank that never asked is at call 0 and has answered nothing: it need not be waited for.
        return not set(self._outstanding) - set(self._asked) - self._lost

    def _decide(self) -> int:
        bounds = [self._asked[r] + 1 if r in self._asked else h for r, h in self._outstanding.items()
                  if r not in self._lost]
        self.decision_index = max(bounds, default=0)
        return self.decision_index
