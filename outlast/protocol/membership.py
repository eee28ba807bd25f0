"""Who holds which rank in a generation of a live group, and who sends the state to whom.

A member is a process, named by an id the controller gives it (a rank number is not a name: the
replacement of rank 1 is rank 1 too). A generation's membership lists the member of each rank;
a member new to the group receives the whole state from one member that kept it.

A run whose ranks split the optimizer's state in `shards` (`LiveTraining(shards=...)`) holds each shard on every
`shards`-th rank: shard s on ranks s, s + shards, s + 2 * shards..., one copy in each replica of the model's ranks.
A joiner takes the state from a rank that holds its shard (`sender`), and a shard whose every holder is lost
(`unheld_shards`) cannot be sent by anyone: the run restarts from its newest checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


class MembershipError(ValueError):
    """A membership that cannot be formed; the message says what is wrong."""


@dataclass(frozen=True)
class Membership:
    """Generation `generation`: `members[r]` holds rank r. `joiners` are the ranks whose members
    hold no state yet; `source` is the rank that sends them the state (None when nobody joins).
    `planned`: every member of the generation before lives (a drained rank moves, ranks are added), so
    the ranks finish the step in flight and form this generation after it, throwing no step away."""

    generation: int
    members: tuple[str, ...]
    joiners: tuple[int, ...] = ()
    source: int | None = None
    planned: bool = False

    def __post_init__(self) -> None:
        if len(set(self.members)) != len(self.members):
            raise MembershipError(f"generation {self.generation} names a member twice: {list(self.members)}")
        if any(not 0 <= r < len(self.members) for r in self.joiners):
            raise MembershipError(f"generation {self.generation}: joiner ranks {list(self.joiners)} are not "
                                  f"all below its world size {len(self.members)}")
        if self.joiners and (self.source is None or self.source in self.joiners):
            raise MembershipError(f"generation {self.generation}: ranks {list(self.joiners)} join, so a rank "
                                  f"that kept the state must send it; got source={self.source}")

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, member: str) -> int | None:
        return self.members.index(member) if member in self.members else None

    def sender(self, joiner: int, shards: int = 1) -> int:
        """The rank that sends `joiner` the state: the lowest that kept it and holds the joiner's shard (with one
        shard, `source`)."""
        holders = [r for r in range(joiner % shards, self.world_size, shards) if r not in self.joiners]
        if not holders:
            raise MembershipError(f"generation {self.generation}: rank {joiner} joins, and every rank holding its "
                                  f"shard {joiner % shards} of {shards} joins too: nobody can send it")
        return holders[0]

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "members": list(self.members),
                           "joiners": list(self.joiners), "source": self.source, "planned": self.planned})

    @classmethod
    def from_json(cls, text: str) -> Membership:
        d = json.loads(text)
        return cls(d["generation"], tuple(d["members"]), tuple(d["joiners"]), d["source"], d.get("planned", False))


def first_membership(members: list[str]) -> Membership:
    """Generation 0: every member starts from the same state (the loop's own initialisation)."""
    return Membership(0, tuple(members))


def replace_members(previous: Membership, replacements: dict[str, str]) -> Membership:
    """The next generation: each lost member (a key) gives its rank to its replacement (the value),
    so the replacement reads the same data shard; the lowest rank kept sends the state.

    A lost member's rank keeps its number because a rank's data, and in a bit-identical run its
    place in the reduction, go with the number."""
    unknown = set(replacements) - set(previous.members)
    if unknown:
        raise MembershipError(f"cannot replace {sorted(unknown)}: generation {previous.generation} has "
                              f"members {list(previous.members)}")
    kept = [r for r, m in enumerate(previous.members) if m not in replacements]
    if not kept:
        raise MembershipError(f"every member of generation {previous.generation} is lost: no rank holds the "
                              "state to send, so the run must restart from its newest checkpoint")
    members = tuple(replacements.get(m, m) for m in previous.members)
    joiners = tuple(r for r, m in enumerate(previous.members) if m in replacements)
    return Membership(previous.generation + 1, members, joiners, kept[0] if joiners else None)


def unheld_shards(world_size: int, leaving: set[int], shards: int) -> list[int]:
    """The shards of the optimizer's state whose every holder, in a world of `world_size` ranks, is among `leaving`
    (the group's ranks that are lost or hold no state yet)."""
    return [s for s in range(shards) if all(r in leaving for r in range(s, world_size, shards))]


def member_name(rank: int, incarnation: int) -> str:
    """The member holding `rank` after `incarnation` replacements: the controller names it in the
    membership and in the spawn's environment (`OUTLAST_LIVE_INCARNATION`), the rank names itself."""
    return f"r{rank}i{incarnation}"


# Keys in the controller's live store, under the attempt's prefix (`store_prefix`).
LATEST = "live/latest"


def store_prefix(attempt: int) -> str:
    """Each attempt's generations start at 0 again, in a namespace of their own."""
    return f"outlast/a{attempt}"


def membership_key(generation: int) -> str:
    return f"live/membership/{generation}"


def ready_key(member: str) -> str:
    """Written by a member new to the group once it waits for a generation that names it: a planned generation
    is published only then, so that the ranks that go on never wait for a new member's start."""
    return f"live/ready/{member}"


def joined_key(generation: int) -> str:
    """Written by the rank that sent the state to a generation's joiners, once it went across."""
    return f"live/g{generation}/joined"
