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

A move is a recovery the controller plans (`on_drain`): a drained node's ranks are replaced like dead
ones while they still live. A grow (`on_grow`) is planned the same way: the ranks added to an elastic
run join a generation with a larger world size and take the state from the running ranks. The new
members are forked first, and the next generation, published once they wait for it (`publishable`), is
`planned`: no step is thrown away, the ranks form it after the step in flight, and the drained ranks,
left out of it, exit. A death meanwhile widens it as it widens any recovery.

A shrink (`on_shrink`) answers a lost node with no room elsewhere in an elastic run: the next generation leaves
its ranks out, and the ranks that live go on as a smaller world, with nobody to send the state to. A drained node
with no room elsewhere shrinks an elastic run the same way, planned (`Leave`): its ranks still live, so they finish
the step in flight with the others and leave after it, and no step is thrown away. The group's
ranks are numbered afresh, in order (`slots`); the controller keeps its own numbers for the processes, which
its messages name, and the lost ones stay lost for the rest of the attempt.

A run whose ranks split the optimizer's state (`shards`, told with the word that generation 0 formed) is replaced
live only while every shard keeps a holder (`unheld`): a joiner takes its shard from a rank that holds it. Its
world keeps its layout: it does not shrink live, and grows live by whole replicas. A run of an FSDP2 model over
`live_mesh` (`mesh`, told with that word too) neither shrinks nor grows live, with one shard or more: its mesh keeps
the ranks and the world it was made for, so a smaller or larger world restarts from the newest checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from outlast.protocol.membership import Membership, first_membership, member_name, unheld_shards

MAX_TRANSFER_DEATHS = 2  # deaths during one recovery, beyond the one that began it, before falling back


@dataclass(frozen=True)
class Replace:
    """Fork `member` for `rank` (its `incarnation`) and publish `membership`."""

    rank: int
    incarnation: int
    member: str
    membership: Membership
    reason: str
    charged: bool = True  # False: another rank of the same lost node, whose loss is one failure, charged once


@dataclass(frozen=True)
class Shrunk:
    """Publish `membership`: the ranks that live go on without `ranks` (a lost node's), as a smaller world."""

    ranks: tuple[int, ...]
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


@dataclass(frozen=True)
class Planned:
    """Fork a member for each of `ranks` (rank -> its `incarnations`) on a node that stays (a drained rank's
    replacement, or a rank added), then publish `membership` (planned) once they wait for it
    (`LiveRun.publishable`)."""

    ranks: tuple[int, ...]
    incarnations: dict[int, int]
    membership: Membership
    reason: str


@dataclass(frozen=True)
class Leave:
    """Publish `membership` (planned) once the ranks were told of the drain: `ranks` (a drained node's, with no room
    elsewhere) leave the group after the step in flight, and the others go on as a smaller world."""

    ranks: tuple[int, ...]
    membership: Membership
    reason: str


@dataclass(frozen=True)
class StayPut:
    """Not changed live: the drain or the grow takes the path it takes without live recovery (a checkpoint, a
    restart). `later`: not now, but the live path may open (a recovery under way ends): ask again."""

    reason: str
    later: bool = False


@dataclass
class Recovery:
    """A recovery under way: since the first death (wall time), the ranks replaced so far."""

    since: float
    cause: str
    ranks: list[int] = field(default_factory=list)
    deaths: int = 0
    nodes_lost: set[str] = field(default_factory=set)  # a lost node's ranks die together: one death, one failure
    # The words of its earlier generations, read after a newer one was published (generation -> the steps their
    # sender threw away before it formed): a death right after a generation formed, before its word was read, widens
    # the recovery, and the next generation's sender counts only the steps thrown since.
    earlier: dict[int, int] = field(default_factory=dict)


class LiveRun:
    """One attempt's generations. Generation 0 is the attempt's ranks as spawned (incarnation 0).

    A rank here is the controller's number of it, which its process was spawned with and its messages carry;
    `slots` lists them in the live group's order, so the group's rank of one is its index there. The two are the
    same until a shrink leaves ranks out."""

    def __init__(self, world_size: int, max_transfer_deaths: int = MAX_TRANSFER_DEATHS) -> None:
        self.slots = list(range(world_size))
        self.membership = first_membership([member_name(r, 0) for r in range(world_size)])
        self.incarnation = {r: 0 for r in range(world_size)}
        self.max_transfer_deaths = max_transfer_deaths
        self.recovery: Recovery | None = None
        self.unsent: set[int] = set()  # ranks of the newest generation that have not received the state yet
        self.unreported: set[int] = set()  # replaced ranks whose replacement has not reported yet
        self.formed = False  # the ranks formed generation 0: the loop makes its steps through the live group
        self.unpublished: Membership | None = None  # a planned generation, until its new members wait for it
        self.starting: set[int] = set()  # ranks of that generation whose new member does not wait for it yet
        self.hung: dict[int, str] = {}  # ranks killed for a hang, not yet dead: what their death is
        self.shards = 1  # the optimizer's state is split in this many shards (told when generation 0 formed)
        self.mesh = False  # an FSDP2 model over live_mesh: the world keeps its size (told when generation 0 formed)
        self.left_in: dict[int, int] = {}  # ranks a shrink left out -> the first generation without them
        self.settled = 0  # the generation whose word ended the last recovery (0: the group formed)

    def on_death(self, rank: int, cause: str, wall: float, finished: tuple[int, ...] = (),
                 lost_node: str | None = None) -> Replace | FallBack:
        """`rank` died (killed, raised, its node lost, or killed for a hang): replace it, wherever the caller forks
        the replacement, or fall back. `finished`: ranks whose loop already returned (their process exited
        cleanly). `lost_node`: the node whose loss killed it; the other ranks of that node die with it, and the
        loss is one death of the recovery and one failure, not one per rank."""
        if rank not in self.slots:
            return FallBack(f"rank {rank} is not in generation {self.membership.generation} "
                            f"(ranks {self.slots})")
        if not self.formed:
            return FallBack(f"rank {rank} died before the ranks formed their live group (a loop that does not use "
                            "outlast.train.torch.LiveTraining never does): a replacement would not take the state")
        if finished:
            # They committed the last step and left; a replacement would wait for them to form its group, forever.
            return FallBack(f"rank {rank} died after rank(s) {sorted(finished)} finished their loop: no group is left "
                            "for a replacement to join")
        r = self.recovery
        same_loss = lost_node is not None and self.losing(lost_node)
        if r is None:
            r = self.recovery = Recovery(since=wall, cause=cause)
        elif not same_loss:
            r.deaths += 1
            if r.deaths > self.max_transfer_deaths:
                return FallBack(f"{r.deaths} more ranks died while rank(s) {r.ranks} took the state "
                                f"(more than {self.max_transfer_deaths})")
        unsent = self.unsent | {rank}
        unheld = self.unheld([rank])
        if unheld:
            return FallBack(f"rank {rank} died and {unheld} (generation {self.membership.generation} had ranks "
                            f"{sorted(self.unsent)} still waiting for the state)")
        if lost_node is not None:
            r.nodes_lost.add(lost_node)
        incarnation = self.incarnation[rank] = self.incarnation[rank] + 1
        member = member_name(rank, incarnation)
        kept = [k for k in self.slots if k not in unsent]
        membership = self._next(unsent, kept[0])
        self.membership, self.unsent = membership, unsent
        self.unreported.add(rank)
        if rank not in r.ranks:
            r.ranks.append(rank)
        return Replace(rank, incarnation, member, membership,
                       f"rank {rank} is replaced by {member} in generation {membership.generation}; "
                       f"{self._senders(membership)} the state to rank(s) {sorted(unsent)}, and ranks {kept} go on",
                       charged=not same_loss)

    def on_shrink(self, ranks: list[int], cause: str, wall: float, least: int, node: str,
                  finished: tuple[int, ...] = ()) -> Shrunk | FallBack:
        """Node `node` is lost with `ranks`, and no other node has room for them: the ranks that live go on without
        them when at least `least` (the elastic run's min_workers) are left. The step in flight is thrown away (its
        batches go back to the rest of the epoch, split again between the smaller world)."""
        left = [k for k in self.slots if k not in ranks]
        if not self.formed:
            return FallBack(f"rank(s) {ranks} were lost before the ranks formed their live group")
        if finished:
            return FallBack(f"rank(s) {ranks} were lost after rank(s) {sorted(finished)} finished their loop")
        if why := self._no_smaller_world(len(left), least):
            return FallBack(why)
        if unheld := self.unheld(ranks):
            return FallBack(f"node {node} is lost with rank(s) {ranks}, and {unheld}")
        waiting = sorted(self.unsent - set(ranks))
        if waiting:
            # Their place in the data is told from the sender's, at the world size they were forked for.
            return FallBack(f"rank(s) {waiting} still wait for the state: the world cannot shrink under them")
        r = self.recovery
        if r is None:
            r = self.recovery = Recovery(since=wall, cause=cause)
        elif not self.losing(node):
            r.deaths += 1
            if r.deaths > self.max_transfer_deaths:
                return FallBack(f"{r.deaths} more ranks died while rank(s) {r.ranks} took the state "
                                f"(more than {self.max_transfer_deaths})")
        r.nodes_lost.add(node)
        r.ranks += [k for k in ranks if k not in r.ranks]
        world = self._leave_out(ranks, planned=False)
        self.unreported -= set(ranks)
        for k in ranks:
            self.hung.pop(k, None)
        return Shrunk(tuple(ranks), self.membership,
                      f"rank(s) {ranks} are left out of generation {self.membership.generation}: ranks {left} go on "
                      f"as {len(left)} of {world}, renumbered 0 to {len(left) - 1}, the step in flight thrown away")

    def _no_smaller_world(self, left: int, least: int) -> str:
        """Why the group cannot go on as `left` ranks (the elastic run's min_workers is `least`); "" when it can."""
        if left < least:
            return f"{left} rank(s) would be left, fewer than the run's min_workers={least}"
        if self.mesh:
            return f"the ranks train an FSDP2 model over live_mesh({self.shards}), whose mesh keeps its shape"
        if self.shards > 1:
            return (f"the ranks split the optimizer's state in {self.shards} shards, whose layout a smaller world "
                    "would not keep")
        return ""

    def _leave_out(self, ranks: list[int], planned: bool) -> int:
        """The next generation without `ranks`, nobody joining (the ranks left numbered afresh, in order); returns
        the world size before it."""
        world = len(self.slots)
        self.slots, self.unsent = [k for k in self.slots if k not in ranks], set()
        self.membership = self._next(set(), None, planned=planned)
        self.left_in.update(dict.fromkeys(ranks, self.membership.generation))
        return world

    def unheld(self, ranks: list[int]) -> str:
        """What no rank is left to send when `ranks` are lost at once (a node's: the node's loss falls back at its
        first rank, not after some of its ranks were replaced): "" when the state, every shard of it, still has a
        holder among the ranks that hold it and are not among `ranks`."""
        leaving = {i for i, k in enumerate(self.slots) if k in self.unsent or k in ranks}
        gone = unheld_shards(len(self.slots), leaving, self.shards)
        if not gone:
            return ""
        if self.shards == 1:
            return "no rank that holds the state is left"
        return (f"every rank holding shard(s) {gone} of the optimizer's {self.shards} is lost or waits for the state: "
                "no copy of it is left")

    def _senders(self, membership: Membership) -> str:
        """Who sends the state to whom, for the log: "rank 0 sends", or with shards "ranks 0 (to 2), 1 (to 3) send"."""
        to: dict[int, list[int]] = {}
        for j in membership.joiners:
            to.setdefault(self.slots[membership.sender(j, self.shards)], []).append(self.slots[j])
        if len(to) == 1:
            return f"rank {next(iter(to))} sends"
        return "ranks " + ", ".join(f"{k} (to {v})" for k, v in sorted(to.items())) + " send"

    def _next(self, joiners: set[int], source: int | None, planned: bool = False) -> Membership:
        """The generation after the newest: `slots`' members as they stand, `joiners` and `source` as ranks of the
        controller's numbering (made the group's here)."""
        members = tuple(member_name(r, self.incarnation[r]) for r in self.slots)
        return Membership(self.membership.generation + 1, members, tuple(sorted(self.slots.index(r) for r in joiners)),
                          None if source is None else self.slots.index(source), planned=planned)

    def losing(self, node: str) -> bool:
        """Whether the recovery under way began with, or took in, the loss of `node`."""
        return self.recovery is not None and node in self.recovery.nodes_lost

    def on_hang(self, rank: int, summary: str) -> bool:
        """The hang watch blames `rank`: True when it is killed and its death replaces it (its peers' collective,
        waiting on it, fails when its sockets close). False: the attempt restarts, as without live recovery."""
        if not self.formed or rank not in self.slots or rank in self.hung:
            return False
        self.hung[rank] = summary
        return True

    def first_report(self, rank: int, incarnation: int) -> bool:
        """Whether this report, of `rank`'s process `incarnation`, is the first of its replacement: its index is
        where the rank's reports go on. A drained rank's own reports, made while its replacement starts, are not:
        taken for it, the replacement's first, from its sender's count, was refused as out of order."""
        if rank not in self.unreported or incarnation != self.incarnation[rank]:
            return False
        self.unreported.discard(rank)
        return True

    def superseded(self, rank: int, incarnation: int) -> bool:
        """Whether `rank`'s process `incarnation` is an earlier one than the rank's newest (a replacement was forked
        since: the process died, or was drained and moves)."""
        return rank in self.incarnation and incarnation < self.incarnation[rank]

    def on_joined(self, generation: int, steps_lost: int, wall: float, shards: int = 1,
                  mesh: bool = False) -> Recovered | None:
        """The sending rank of `generation` says the state went across (generation 0: the ranks say the group
        formed, in how many `shards` they split the optimizer's state, and whether over an FSDP2 `mesh`). An older
        generation's word is stale: a newer one was published since, whose joiners still wait."""
        if generation == 0:
            self.formed, self.shards, self.mesh = True, shards, mesh
            return None
        r = self.recovery
        if r is None:
            return None
        if generation != self.membership.generation:
            if self.settled < generation < self.membership.generation:
                r.earlier.setdefault(generation, steps_lost)  # what it cost counts; the recovery goes on
            return None
        self.recovery, self.unsent, self.settled = None, set(), generation
        return Recovered(generation, tuple(r.ranks), r.cause, r.since, max(0.0, wall - r.since),
                         steps_lost + sum(r.earlier.values()))

    def unread(self) -> list[int]:
        """The generations of the recovery under way before the newest whose word was not read: the runtime reads
        them from the store too, so that the steps their senders threw away are counted."""
        r = self.recovery
        if r is None:
            return []
        return [g for g in range(self.settled + 1, self.membership.generation) if g not in r.earlier]

    # ---- planned changes: a drained node's ranks move, an elastic run grows ------------------------------

    def on_drain(self, ranks: list[int], cause: str, wall: float, no_room: str | None,
                 least: int | None = None) -> Planned | Leave | StayPut:
        """A drain notice names `ranks` (alive, on draining nodes). `no_room`: why no node that stays can take
        them, None when one can. `least`: an elastic run's min_workers (None: not elastic), which lets the ranks that
        stay go on without them when there is no room."""
        if not ranks:
            return StayPut("the drained nodes hold no rank of this attempt")
        if not self.formed:
            return StayPut(f"ranks {ranks} are drained before the ranks formed their live group")
        if self.recovery is not None:
            return StayPut(f"ranks {ranks} are drained while rank(s) {self.recovery.ranks} still take the state "
                           f"in generation {self.membership.generation}")
        kept = [k for k in self.slots if k not in ranks]
        if not kept:
            return StayPut(f"every rank ({ranks}) is on a draining node: no rank stays to send the state")
        if unheld := self.unheld(ranks):
            return StayPut(f"ranks {ranks} are drained, and {unheld} on a node that stays")
        if no_room is not None:
            return self._leave(ranks, cause, wall, no_room, least)
        incarnations = {r: self.incarnation[r] + 1 for r in ranks}
        self.incarnation.update(incarnations)
        membership = self._next(set(ranks), kept[0], planned=True)
        self.membership, self.unsent = membership, set(ranks)
        self.unreported |= set(ranks)
        self.recovery = Recovery(since=wall, cause=cause, ranks=sorted(ranks))
        self.unpublished, self.starting = membership, set(ranks)
        return Planned(tuple(sorted(ranks)), incarnations, membership,
                       f"ranks {sorted(ranks)} move: their replacements join generation {membership.generation}, "
                       f"planned, once started; {self._senders(membership)} them the state, and the drained ranks "
                       "exit")

    def on_retired_death(self) -> Membership | None:
        """A drained process that the planned generation under way leaves out died (killed, or it raised) before that
        generation formed. Its vote of the step in flight may never come, and the others, waiting for it, take a
        planned generation for no sign that it is lost: the newest generation goes out again unplanned (the same
        members, joiners and source), so that the step in flight is thrown away everywhere, as for any death, and
        the group forms without that process. Returns it to publish now; None when the planned generation formed
        already, or waits for its new members still (it goes out unplanned once they wait)."""
        m = self.membership
        if self.recovery is None or not m.planned:
            return None
        if self.unpublished is not None:
            self.membership = self.unpublished = Membership(m.generation, m.members, m.joiners, m.source)
            return None
        self.membership = Membership(m.generation + 1, m.members, m.joiners, m.source)
        return self.membership

    def _leave(self, ranks: list[int], cause: str, wall: float, no_room: str, least: int | None) -> Leave | StayPut:
        why = f"no node that stays has room for ranks {ranks}: {no_room}"
        if least is None:
            return StayPut(why)
        if cannot := self._no_smaller_world(len(self.slots) - len(ranks), least):
            return StayPut(f"{why}; and {cannot}")
        world = self._leave_out(ranks, planned=True)
        membership, left = self.membership, self.slots
        self.recovery = Recovery(since=wall, cause=cause, ranks=sorted(ranks))
        self.unpublished, self.starting = membership, set()
        return Leave(tuple(sorted(ranks)), membership,
                     f"{why}: they leave the group after the step in flight, and ranks {left} go on in generation "
                     f"{membership.generation} as {len(left)} of {world}, renumbered 0 to {len(left) - 1}, planned: "
                     "no step thrown away")

    def added_for(self, to_workers: int) -> list[int]:
        """The controller's numbers of the ranks a grow to `to_workers` adds: after every number this attempt has
        given (a shrink's lost ranks keep theirs), so that no tracker takes a new rank for a lost one."""
        first = max(self.incarnation) + 1
        return list(range(first, first + to_workers - self.membership.world_size))

    def on_grow(self, to_workers: int, cause: str, wall: float) -> Planned | StayPut:
        """The elastic run has room for `to_workers` (more than it has): the added ranks (`added_for`) join a
        planned generation of that size, after the others in the group's order; its rank 0 sends them the state."""
        world = self.membership.world_size
        if to_workers <= world:
            return StayPut(f"{to_workers} workers is no grow from {world}")
        if not self.formed:
            return StayPut(f"the run may grow to {to_workers} workers before the ranks formed their live group")
        if self.recovery is not None:
            return StayPut(f"rank(s) {self.recovery.ranks} still take the state in generation "
                           f"{self.membership.generation}: the grow waits for it", later=True)
        if self.mesh:
            return StayPut(f"the ranks train an FSDP2 model over live_mesh({self.shards}), whose mesh keeps its shape: "
                           f"{to_workers} workers restart from the newest checkpoint")
        if to_workers % self.shards:
            # A restart at that size would fail in the loop as well: the grow waits for room for whole replicas.
            return StayPut(f"the ranks split the optimizer's state in {self.shards} shards: {to_workers} workers is not "
                           "a whole number of replicas of them", later=True)
        added = self.added_for(to_workers)
        incarnations = dict.fromkeys(added, 0)
        self.incarnation.update(incarnations)
        source = self.slots[0]
        self.slots += added
        membership = self._next(set(added), source, planned=True)
        self.membership, self.unsent = membership, set(added)
        self.unreported |= set(added)
        self.recovery = Recovery(since=wall, cause=cause, ranks=added)
        self.unpublished, self.starting = membership, set(added)
        return Planned(tuple(added), incarnations, membership,
                       f"ranks {added} join generation {membership.generation} ({world} to {to_workers} ranks), "
                       f"planned, once started; {self._senders(membership)} them the state")

    def on_started(self, member: str) -> None:
        """`member` waits in the store for the planned generation that names it."""
        if self.unpublished is not None and (index := self.unpublished.rank_of(member)) is not None:
            self.starting.discard(self.slots[index])

    def starting_members(self) -> list[str]:
        """The planned generation's new members that have not said they wait for it yet."""
        if self.unpublished is None:
            return []
        return [member_name(r, self.incarnation[r]) for r in sorted(self.starting)]

    def publishable(self, told: bool) -> Membership | None:
        """The planned generation, to publish now: once every new member of it waits for it (the ranks that go on
        never wait for a fork and its imports), and once `told` (the ranks know the drain's notice: a drained rank
        answers get_preemption_info() with it before it leaves)."""
        if self.unpublished is None or self.starting or not told:
            return None
        return self.take_unpublished()

    def abandon_move(self) -> str:
        """The drained ranks returned from the loop before the planned generation went out (the training ended
        first): it never will, and their exits are theirs. Returns why, for the log."""
        ranks = self.recovery.ranks if self.recovery is not None else []
        moot = self.take_unpublished()
        assert moot is not None, "no planned generation to abandon"
        self.recovery, self.unsent = None, set()
        return f"the loop ended before generation {moot.generation} went out: the change of ranks {ranks} is moot"

    def joining(self) -> list[int]:
        """The ranks (the controller's numbers) that join the planned generation not published yet."""
        return [self.slots[i] for i in self.unpublished.joiners] if self.unpublished is not None else []

    def take_unpublished(self) -> Membership | None:
        """The planned generation not published yet, to publish now (its members started, or a death must be
        answered by the generation after it: generations are published in order)."""
        membership, self.unpublished, self.starting = self.unpublished, None, set()
        return membership
