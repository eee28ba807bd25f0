"""The preemption answer without a barrier: horizons granted to each rank.

Each worker counts its `get_preemption_info()` calls. A grant lets it answer None
locally, with no message, for calls below a horizon H and for `valid_s` seconds after
the grant, whichever ends first; then it asks again. A notice fixes D, the first call
that returns it, the same on every rank: every rank returns None before D and the
notice from D on, and no rank ever answered None locally at or past D.

Safety. A rank's next call is at most the horizon of its last grant (it cannot pass H
without asking), and exactly the index it sent if it is asking now. So any
D >= max over ranks of those bounds is safe, whenever it is fixed.

Promptness: the notice reaches every rank within about max(valid_s, one step) of the
drain (plus the skew between ranks), however long a step is. Grants are short in calls as
well as in time: H = index + n, where n is what the rank called in `valid_s` at the rate
it showed since its previous query, rounded down (at least 1). A rank's bound is exact when n = 1 (its
next call is H) or when it has asked since the notice. So:
- a loop slower than two calls per `valid_s` holds grants of n = 1: every bound is exact at
  the notice, and D, fixed at once, is each rank's next call, at most one step away;
- a faster loop (n > 1) may be anywhere below its horizon, and may have slowed down since
  its grant (a burst of calls, then a long step; a report() waiting for an upload), so its
  horizon is not used: the book waits for each such rank's next call, which comes within
  `valid_s` of its grant (or at its horizon, whichever is first). A rank that asks
  meanwhile is parked (its answer waits) when every rank still to ask has an expired grant
  and so asks at its very next call: in a loop whose ranks call in the same order (the
  guide's pattern) those reach that call without waiting for the parked rank. While some
  rank still holds a live grant it could block in a collective on the parked one, so the
  asker is held instead: None for this call, ask again at the next (then it is exact).
  D = the largest exact bound once every rank has one: the call where the last rank asks,
  or the next call of a held rank.
- If some rank has not asked `collect_s` after the first query that followed the notice (a
  rank stuck, a loop that stopped asking), D falls back to the horizons: late, but safe.
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
class NoticeAt:
    decision_index: int  # calls with index >= decision_index return the notice


@dataclass(frozen=True)
class Answer:
    """The answer to rank `rank`'s query at call `index` (a parked query is answered later)."""

    rank: int
    index: int
    reply: Grant | NoticeAt


@dataclass
class _Granted:
    index: int  # the call it asked at
    horizon: int
    at: float


@dataclass
class HorizonBook:
    valid_s: float = 0.25
    collect_s: float = 1.0  # how long ranks that asked after a notice wait for the others' calls
    max_step: int = 1 << 20
    decision_index: int | None = None
    noticed_at: float | None = None
    _granted: dict[int, _Granted] = field(default_factory=dict)
    _parked: dict[int, int] = field(default_factory=dict)  # rank -> the call it waits at
    _asked_since: float | None = None  # the first query after the notice
    _lost: set[int] = field(default_factory=set)

    def on_query(self, rank: int, index: int, now: float) -> list[Answer]:
        """Rank `rank` asks at call `index`: its own answer, if it has one now, and any parked ones
        that this query answers."""
        if self.decision_index is not None:
            return [Answer(rank, index, NoticeAt(self.decision_index))]
        if self.noticed_at is None:
            n = self._calls_per_grant(self._granted.get(rank), index, now)
            self._granted[rank] = _Granted(index, index + n, now)
            return [Answer(rank, index, Grant(index + n, self.valid_s))]
        if self._asked_since is None:
            self._asked_since = now
        self._parked[rank] = index
        waiting = self._inexact()
        if not waiting:
            return self._decide()
        if any(now - self._granted[r].at <= self.valid_s for r in waiting):
            del self._parked[rank]  # hold: a rank with a live grant may wait on this one in a collective
            self._granted[rank] = _Granted(index, index + 1, now)
            return [Answer(rank, index, Grant(index + 1, float("inf")))]
        return []  # parked: every rank still to ask asks at its next call

    def preempt(self, now: float) -> list[Answer]:
        """A notice arrived: fix D now if every rank's bound is exact, else wait for the calls that tell."""
        if self.noticed_at is None:
            self.noticed_at = now
        return self._decide_if_exact()

    def tick(self, now: float) -> list[Answer]:
        """Ranks that asked waited `collect_s` for one that did not: fix D from the horizons."""
        if self.decision_index is None and self._asked_since is not None \
                and now - self._asked_since >= self.collect_s:
            return self._decide()
        return []

    def lose_rank(self, rank: int, now: float) -> list[Answer]:
        """A rank gone (its node, or it returned): nobody waits for it."""
        self._lost.add(rank)
        self._parked.pop(rank, None)
        return self._decide_if_exact() if self.noticed_at is not None else []

    def release(self) -> list[Answer]:
        """The attempt is over (an interrupt, a lost lease, a restart): the ranks still waiting for an answer
        get it now, the notice fixed from what is known, so none waits on a decision that will not come."""
        if not self._parked:
            return []
        if self.decision_index is not None:
            answers = [Answer(r, i, NoticeAt(self.decision_index)) for r, i in sorted(self._parked.items())]
            self._parked.clear()
            return answers
        return self._decide()

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
        return max(1, min(self.max_step, math.floor((index - last.index) * self.valid_s / elapsed)))

    def _inexact(self) -> list[int]:
        """Ranks that have not asked since the notice and may be anywhere below a horizon of n > 1 calls."""
        return [r for r, g in self._granted.items()
                if r not in self._lost and r not in self._parked and g.horizon - g.index > 1]

    def _decide_if_exact(self) -> list[Answer]:
        if self.decision_index is not None or self._inexact():
            return []
        return self._decide()

    def _decide(self) -> list[Answer]:
        bounds = [self._parked.get(r, g.horizon) for r, g in self._granted.items() if r not in self._lost]
        bounds += [i for r, i in self._parked.items() if r not in self._granted]
        self.decision_index = d = max(bounds, default=0)
        answers = [Answer(r, i, NoticeAt(d)) for r, i in sorted(self._parked.items())]
        self._parked.clear()
        return answers
