"""Hangs: a rank that makes no progress for too long is found, explained from every rank's stacks, and
its attempt ends as a failure.

Progress is what the loop already does (report, get_preemption_info, collectives, heartbeat),
counted by each rank's watch thread (`outlast/train/watch.py`). A hang is some live rank
without progress for the hang timeout. `FailureConfig.hang_timeout_s=None` (the default)
adapts to the run: ten times its slowest step so far (the longest gap between two progress
counts of any rank, the attempt's start-up included), never under five minutes. A fixed number
is wrong for someone: 60 s would kill a loop of 60 s steps at its first slow step, and
30 minutes leaves a loop of 20 ms steps hung for 90,000 of its steps. Ten slowest steps leave
room for a step that is much slower than usual (a checkpoint, an evaluation) without waiting
long after the loop has stopped; five minutes covers the first steps, whose pace is not known
yet, and a slow storage write. A first checkpoint upload longer than the floor is the case it
gets wrong: set hang_timeout_s, or call `outlast.train.heartbeat()` while saving.

Before anything is killed, every rank is asked for its stacks; the attempt ends once all
have answered, or after `DUMP_WAIT_S`. Stacks that are the same but for thread ids are kept
once, with the ranks that share them, so a thousand ranks waiting in one all_reduce cost one
stack. Pure: times come in as arguments.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from outlast.protocol import messages as m
from outlast.storage.records import HangRecord, StackGroup

FLOOR_S = 300.0
FACTOR = 10.0
DUMP_WAIT_S = 10.0
_COLLECTIVE = re.compile(r"all_reduce|allreduce|all_gather|reduce_scatter|broadcast|barrier|all_to_all|"
                         r"\bwait\b|recv|send|_wait_for|collective", re.I)
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


@dataclass(frozen=True)
class Hang:
    ranks: list[int]  # live ranks without progress for limit_s
    quiet_s: float  # the longest of them
    limit_s: float
    adaptive: bool


@dataclass
class HangWatch:
    attempt: int
    ranks: int
    timeout_s: float | None  # None: adaptive
    started: float
    last: dict[int, float] = field(default_factory=dict)  # rank -> when its count last changed
    counts: dict[int, int] = field(default_factory=dict)
    slowest_s: float = 0.0
    hang: Hang | None = None  # found: the stacks are being collected
    asked: list[int] = field(default_factory=list)
    dumps: dict[int, m.StackDump] = field(default_factory=dict)
    dumps_by: float = math.inf
    # Until then no live rank can pass the limit: the quietest rank's last progress plus the limit, when last
    # looked. Progress only moves a rank's time later, the limit only grows and ranks only leave, so the
    # bound holds, and `check` (called at every step of the controller) costs nothing until it is reached.
    calm_until: float = -math.inf

    def limit_s(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return max(FLOOR_S, FACTOR * self.slowest_s)

    def on_progress(self, rank: int, count: int, now: float) -> None:
        if not 0 <= rank < self.ranks or self.counts.get(rank) == count:
            return
        self.slowest_s = max(self.slowest_s, now - self.last.get(rank, self.started))
        self.counts[rank] = count
        self.last[rank] = now

    def restart_clock(self, replaced: int, now: float) -> None:
        """Live recovery killed `replaced` for the hang: the ranks that waited on it go on, and its replacement
        counts its progress from nothing. Every rank's silence starts now."""
        self.counts.pop(replaced, None)
        self.last = dict.fromkeys(range(self.ranks), now)
        self.calm_until = -math.inf

    def check(self, live: list[int], now: float) -> Hang | None:
        """A hang to explain, once: the ranks in `live` that made no progress for the limit."""
        if self.hang is not None or now < self.calm_until:
            return None
        limit = self.limit_s()
        quiet = {r: now - self.last.get(r, self.started) for r in live}
        stuck = sorted(r for r, q in quiet.items() if q > limit)
        if not stuck:
            # A microsecond short of the bound, so that rounding never skips a check that would find a hang.
            self.calm_until = min((self.last.get(r, self.started) for r in live), default=math.inf) + limit - 1e-6
            return None
        self.hang = Hang(stuck, max(quiet[r] for r in stuck), limit, self.timeout_s is None)
        self.asked = sorted(live)
        self.dumps_by = now + DUMP_WAIT_S
        return self.hang

    def on_dump(self, dump: m.StackDump) -> None:
        if self.hang is not None and dump.rank in self.asked:
            self.dumps[dump.rank] = dump

    def explained(self, now: float) -> bool:
        """Every rank asked has sent its stacks, or the wait for them is over."""
        return self.hang is not None and (set(self.dumps) >= set(self.asked) or now >= self.dumps_by)

    def blamed(self) -> int:
        assert self.hang is not None
        return blame(self.hang, self.asked, self.dumps)

    def record(self, wall: float) -> HangRecord:
        assert self.hang is not None
        return HangRecord(attempt=self.attempt, time=wall, summary=summarize(self.hang, self.asked, self.dumps),
                          stacks=group_stacks(self.dumps))


def group_stacks(dumps: dict[int, m.StackDump]) -> list[StackGroup]:
    groups: dict[tuple[str, str], list[int]] = {}
    texts: dict[tuple[str, str], str] = {}
    for rank in sorted(dumps):
        d = dumps[rank]
        key = (d.where, _ADDRESS.sub("0x...", d.text))
        groups.setdefault(key, []).append(rank)
        texts.setdefault(key, d.text)
    return [StackGroup(ranks=ranks, where=key[0], text=texts[key]) for key, ranks in groups.items()]


def _places(dumps: dict[int, m.StackDump]) -> list[tuple[str, list[int]]]:
    """Where the ranks are, the ranks waiting in a collective first: they are "the rest", and the ranks
    elsewhere are what they wait for."""
    where: dict[str, list[int]] = {}
    for rank in sorted(dumps):
        where.setdefault(dumps[rank].where, []).append(rank)
    return sorted(where.items(), key=lambda kv: (not _COLLECTIVE.search(kv[0]), -len(kv[1]), kv[1][0]))


def blame(hang: Hang, asked: list[int], dumps: dict[int, m.StackDump]) -> int:
    """The rank the hang is charged to, the one the summary points at: a rank that sent no stacks (stuck in
    a native call, or gone), else one somewhere the rest are not, else the first without progress."""
    silent = sorted(set(asked) - set(dumps))
    if silent:
        return silent[0]
    order = _places(dumps)
    if len(order) > 1:
        return min(r for _, ranks in order[1:] for r in ranks)
    return hang.ranks[0]


def summarize(hang: Hang, asked: list[int], dumps: dict[int, m.StackDump]) -> str:
    """One message: who made no progress, and which ranks are somewhere the others are not."""
    how = (f"hang_timeout_s {hang.limit_s:.0f} s, adaptive: 10 x the slowest step, at least {FLOOR_S:.0f} s"
           if hang.adaptive else f"FailureConfig.hang_timeout_s={hang.limit_s:g}")
    head = f"{_ranks(hang.ranks)} made no progress for {hang.quiet_s:.0f} s ({how})"
    order = _places(dumps)
    parts = []
    if len(order) == 1:
        parts.append(f"every rank that answered is in {order[0][0]}")
    elif order:
        (rest_at, rest), others = order[0], order[1:]
        differ = "; ".join(f"{_ranks(rs)} {'is' if len(rs) == 1 else 'are'} in {at}" for at, rs in others)
        parts.append(f"{differ}, while {_ranks(rest)} {'waits' if len(rest) == 1 else 'wait'} in {rest_at}")
    silent = sorted(set(asked) - set(dumps))
    if silent:
        parts.append(f"{_ranks(silent)} sent no stacks within {DUMP_WAIT_S:.0f} s (a native call holding the GIL, "
                     "or a process that is gone)")
    return head + (": " + "; ".join(parts) if parts else "")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_span(ranks)}"


def _span(ranks: list[int]) -> str:
    if len(ranks) > 8:
        return f"{ranks[:4]}...{ranks[-2:]} ({len(ranks)} ranks)".replace("]...[", ", ..., ")
    return str(ranks)
