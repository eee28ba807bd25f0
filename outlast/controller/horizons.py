"""The preemption answer without a barrier: horizons granted to each rank.

Each worker counts its `get_preemption_info()` calls. A grant lets it answer None
locally, with no message, for calls below a horizon H and for `valid_s` seconds after
the grant, whichever ends first; then it asks again. A notice fixes D, the first call
that returns it, the same on every rank: every rank returns None before D and the
notice from D on, and no rank ever answered None locally at or past D.

Safety. A rank's next call is at most the horizon of its last grant (it cannot pass H
without asking), and exactly the index it sent if it is asking now. So any
D >= max over ranks of those bounds is safe, whenever it is fixed.

Promptness: the notice reaches every rank within max(valid_s, one step) of the drain
(plus the skew between ranks), however long a step is. Grants are short in calls as
well as in time: H = index + n, where n is what the rank called in `valid_s` at the
rate it showed since its previous query (at least 1). So:
- a loop slower than one call per `valid_s` gets n = 1: its bound is exactly its
  next call, and D, fixed the moment the notice comes, is that call, one step away;
- a faster loop holding a grant younger than `valid_s` is at most n calls, about
  `valid_s` of its calls, short of its horizon: D is reached within about `valid_s`;
- a rank whose grant is older than `valid_s` and had n > 1 (a burst of calls, then a
  long step) asks at its very next call, and its horizon may be far off: D waits for
  that call instead of using the horizon. Ranks that ask meanwhile are parked (their
  answer waits), since answering them None would push D a step later. In a loop
  whose ranks call in the same order (the guide's pattern) the waited-for rank reaches
  that call too; if it does not within `collect_s` of the first park (a rank stuck in a
  collective that waits for a parked one), D falls back to the horizons, late but safe.
A rank that never asked is at call 0 and bounds nothing; a lost rank is not waited for.
Pure: time comes in as an argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Grant:
    horizon: int  # calls with index < horizon may return None without asking...
    valid_s: float  # ...for this long after the grant arrives


@dataclass(frozen=True)
class Decision:
    decision_index: int  # calls with index >= decision_index return the notice


@dataclass(frozen=True)
class Answer:
    """The answer to rank `rank`'s query at call `index` (a parked query is answered later)."""

    rank: int
    index: int
    reply: Grant | Decision


@dataclass
class _Granted:
    index: int  # the call it asked at
    horizon: int
    at: float


@dataclass
class HorizonBook:
    valid_s: float = 0.25
    collect_s: float = 0.5  # how long a parked rank waits for one that has yet to ask
    max_step: int = 1 << 20
    decision_index: int | None = None
    noticed_at: float | None = None
    _granted: dict[int, _Granted] = field(default_factory=dict)
    _parked: dict[int, int] = field(default_factory=dict)  # rank -> the call it waits at
    _parked_since: float | None = None
    _lost: set[int] = field(default_factory=set)

    def on_query(self, rank: int, index: int, now: float) -> list[Answer]:
        """Rank `rank` asks at call `index`: its own answer, if it has one now, and any parked ones
        that this query settles."""
        if self.decision_index is not None:
            return [Answer(rank, index, Decision(self.decision_index))]
        if self.noticed_at is None:
            n = self._calls_per_grant(self._granted.get(rank), index, now)
            self._granted[rank] = _Granted(index, index + n, now)
            return [Answer(rank, index, Grant(index + n, self.valid_s))]
        self._parked[rank] = index
        if self._parked_since is None:
            self._parked_since = now
        return self._decide_if_bounded(now)

    def preempt(self, now: float) -> list[Answer]:
        """A notice arrived: fix D now if every rank's bound is near, else wait for the calls that tell."""
        if self.noticed_at is None:
            self.noticed_at = now
        return self._decide_if_bounded(now)

    def tick(self, now: float) -> list[Answer]:
        """Parked ranks waited `collect_s` for a rank that did not ask: fix D from the horizons."""
        if self.decision_index is None and self._parked_since is not None \
                and now - self._parked_since >= self.collect_s:
            return self._decide()
        return self._decide_if_bounded(now) if self.noticed_at is not None else []

    def lose_rank(self, rank: int, now: float) -> list[Answer]:
        """A rank gone (its node, or it returned): nobody waits for it."""
        self._lost.add(rank)
        self._parked.pop(rank, None)
        return self._decide_if_bounded(now) if self.noticed_at is not None else []

    @property
    def watched(self) -> bool:
        """Whether the loop asks get_preemption_info() at all (then it is waited for to save)."""
        return bool(self._granted)

    def _calls_per_grant(self, last: _Granted | None, index: int, now: float) -> int:
        if last is None or index <= last.index:
            return 1
        elapsed = now - last.at
        if elapsed <= 0:
            return self.max_step
        return max(1, min(self.max_step, math.ceil((index - last.index) * self.valid_s / elapsed)))

    def _unknown(self, now: float) -> list[int]:
        """Ranks whose next call may be far below their horizon: a grant of n > 1 that has expired in time."""
        return [r for r, g in self._granted.items()
                if r not in self._lost and r not in self._parked
                and g.horizon - g.index > 1 and now - g.at > self.valid_s]

    def _decide_if_bounded(self, now: float) -> list[Answer]:
        if self.decision_index is not None or self._unknown(now):
            return []
        return self._decide()

    def _decide(self) -> list[Answer]:
        bounds = [self._parked.get(r, g.horizon) for r, g in self._granted.items() if r not in self._lost]
        bounds += [i for r, i in self._parked.items() if r not in self._granted]
        self.decision_index = d = max(bounds, default=0)
        answers = [Answer(r, i, Decision(d)) for r, i in sorted(self._parked.items())]
        self._parked.clear()
        return answers
