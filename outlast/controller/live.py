"""Live recovery in the controller (`FailureConfig(live_recovery=True)`): when a rank dies, keep the
survivors and replace it, or fall back to a restart from the newest checkpoint. Pure: it takes the
deaths and the joins with their times, and returns decisions with their reasons; `live_steps.py`
carries them out.

A generation is a membership the controller publishes in the store it holds (never a rank's):
the ranks that live go on in it, and a replacement, forked for the lost rank's number, takes the
state from the lowest rank that kept it (`outlast/train/live/`). A recovery is under way from the
death until that rank says the state went across (`joined`). A death meanwhile (the replacement's,
or a survivor's) widens it: the next generation replaces that member too, and every member that has
not received the state yet receives it. There is no one left to send it when every member that held
the state is gone, and replacements that keep dying in their transfer are not worth waiting for past
`max_transfer_deaths`: both fall back to a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from outlast.protocol.membership import Membership, first_membership, member_name

MAX_TRANSFER_DEATHS = 2  # deaths during one recovery, beyond the one that began it, before falling back


@dataclass(frozen=True)
class Replace:
    """Fork `member` for `rank` (its `incarnation`) and publish `membership`."""

    rank: int
    incarnation: int
    member: str
    membership: Membership
    reason: str


@dataclass(frozen=True)
class FallBack:
    """Restart the attempt from the newest checkpoint, as without live recovery."""

    reason: str


@dataclass(frozen=True)
class Recovered:
    """A recovery is over: the replacements hold the state. `seconds` from the first death to the
    state received; `steps_lost` as the sending rank counted them (steps it threw away)."""

    generation: int
    ranks: tuple[int, ...]
    cause: str
    since: float
    seconds: float
    steps_lost: int


@dataclass
class Recovery:
    """A recovery under way: since the first death (wall time), the ranks replaced so far."""

    since: float
    cause: str
    ranks: list[int] = field(default_factory=list)
    deaths: int = 0


class LiveRun:
    """One attempt's generations. Generation 0 is the attempt's ranks as spawned (incarnation 0)."""

    def __init__(self, world_size: int, max_transfer_deaths: int = MAX_TRANSFER_DEATHS) -> None:
        self.membership = first_membership([member_name(r, 0) for r in range(world_size)])
        self.incarnation = {r: 0 for r in range(world_size)}
        self.max_transfer_deaths = max_transfer_deaths
        self.recovery: Recovery | None = None
        self.unsent: set[int] = set()  # ranks of the newest generation that have not received the state yet
        self.unreported: set[int] = set()  # replaced ranks whose replacement has not reported yet
        self.formed = False  # the ranks formed generation 0: the loop makes its steps through the live group
        self.hung: dict[int, str] = {}  # ranks killed for a hang, not yet dead: what their death is

    def on_death(self, rank: int, cause: str, wall: float) -> Replace | FallBack:
        """`rank` died (killed, raised, its node lost, or killed for a hang): replace it, wherever the caller forks
        the replacement, or fall back."""
        if not 0 <= rank < self.membership.world_size:
            return FallBack(f"rank {rank} is not in generation {self.membership.generation} "
                            f"({self.membership.world_size} ranks)")
        if not self.formed:
            return FallBack(f"rank {rank} died before the ranks formed their live group (a loop that does not use "
                            "outlast.train.torch.LiveTraining never does): a replacement would not take the state")
        r = self.recovery
        if r is None:
            r = self.recovery = Recovery(since=wall, cause=cause)
        else:
            r.deaths += 1
            if r.deaths > self.max_transfer_deaths:
                return FallBack(f"{r.deaths} more ranks died while rank(s) {r.ranks} took the state "
                                f"(more than {self.max_transfer_deaths})")
        unsent = self.unsent | {rank}
        kept = [k for k in range(self.membership.world_size) if k not in unsent]
        if not kept:
            return FallBack(f"rank {rank} died and no rank that holds the state is left "
                            f"(generation {self.membership.generation} had ranks "
                            f"{sorted(self.unsent)} still waiting for it)")
        incarnation = self.incarnation[rank] + 1
        member = member_name(rank, incarnation)
        members = tuple(member if k == rank else m for k, m in enumerate(self.membership.members))
        membership = Membership(self.membership.generation + 1, members, tuple(sorted(unsent)), kept[0])
        self.membership, self.unsent = membership, unsent
        self.incarnation[rank] = incarnation
        self.unreported.add(rank)
        if rank not in r.ranks:
            r.ranks.append(rank)
        return Replace(rank, incarnation, member, membership,
                       f"rank {rank} is replaced by {member} in generation {membership.generation}; rank {kept[0]} "
                       f"sends the state to rank(s) {sorted(unsent)}, and ranks {kept} go on")

    def on_hang(self, rank: int, summary: str) -> bool:
        """The hang watch blames `rank`: True when it is killed and its death replaces it (its peers' collective,
        waiting on it, fails when its sockets close). False: the attempt restarts, as without live recovery."""
        if not self.formed or not 0 <= rank < self.membership.world_size or rank in self.hung:
            return False
        self.hung[rank] = summary
        return True

    def owed_reports(self, rank: int) -> list[int]:
        """A report from `rank`, a rank that kept the state, while a recovery is under way and before the state went
        across: no step commits in a generation still forming, so it reports a step committed before the death, and
        the ranks lost since (that voted for it) died before they reported it. Their replacements report from the
        next step on: the controller counts the lost ranks' reports of this one, which never come."""
        r = self.recovery
        if r is None or rank in self.unsent:
            return []
        return sorted(set(r.ranks) & self.unreported)

    def first_report(self, rank: int) -> bool:
        """Whether this is the first report of `rank`'s replacement: its index is where the rank's reports go on."""
        if rank not in self.unreported:
            return False
        self.unreported.discard(rank)
        return True

    def on_joined(self, generation: int, steps_lost: int, wall: float) -> Recovered | None:
        """The sending rank of `generation` says the state went across (generation 0: rank 0 says the group
        formed). An older generation's word is stale: a newer one was published since, whose joiners still wait."""
        if generation == 0:
            self.formed = True
            return None
        r = self.recovery
        if r is None or generation != self.membership.generation:
            return None
        self.recovery, self.unsent = None, set()
        return Recovered(generation, tuple(r.ranks), r.cause, r.since, max(0.0, wall - r.since), steps_lost)
