"""Live recovery in the simulator: ranks that run the real step-commit protocol against the real controller.

What is real: the controller core with its `LiveRun` (`outlast/controller/live.py`, `live_steps.py`), the store's
side of it (`outlast/train/live/store_host.py`'s `LiveStore`), and on each rank `LiveRank`'s bookkeeping
(`outlast/train/live/live_rank.py`: what it offers a new group, the survivors' agreed step, the announcement, the
ledger) with its votes (`commit_store.StepVotes`, compare-and-set) and its rendezvous (`rendezvous.py`), over an
in-memory store with torch.distributed's store calls. What is simulated: gloo (a group per generation whose
collectives break when a member dies or leaves), the time a transfer takes, and the model's weights, which are a
step count: the steps applied, in order. The faults kill a rank when it next reaches a point of its step
(`POINTS`), so every point is reached on purpose.

A sharded run (`LoopSpec.shards`, `LiveTraining(shards=S)`) keeps a step count per shard: a rank's own shard moves
with each committed step, the others when it gathers them (after each committed step, and each time its group forms:
a fault point of its own, `SHARD_POINTS`). Each joiner takes the state from `Membership.sender`, several senders in
one generation, and the word that it went across comes once all are done, as `LiveRank._form` says it. A rank that
took its state settles its count of reports on the highest the first step's gather after that tells (the real
`reports_after_gather`; the simulated gather tells the counts every time, which changes nothing after that one).

A run of an FSDP2 model over `live_mesh(S)` (`LoopSpec.mesh`) runs `live_mesh.py`'s loop: its collectives in the
mesh's groups inside forward and backward, each step voted on and thrown away on every rank when it broke anywhere.

Planned changes (`schedule.py`'s `_planned`, `drain_at` and `grow_at`): a rank's node is drained as the rank reaches a
point of its step (with a deadline or none, with room elsewhere or none, in elastic runs and not), and nodes join an
elastic run that started below its size. The real controller decides (a move, a `Leave`, a grow, or `StayPut`); the
driver reads the new members' word that they wait (`LiveStore.ready`, as the runtime does) and publishes the planned
generation; the ranks commit the step in flight as REGROUP and form it before the next step's reduction, its
gradients kept, as `LiveTraining.step` does; a rank it leaves out leaves through the real `LiveRank.leave`
(SystemExit(0), no WorkerDone, as `worker_main.py` takes it), and so does a drained rank that a death's generation
leaves out (`LiveTraining._rejoin`). The controller's answers go to the process of a rank that it names by
incarnation: a drained rank and its replacement live side by side.

`LiveWatch` checks, on every schedule: no step applied by some ranks and thrown away by others; no committed step
lost, and no step's work lost by a live recovery (the survivors keep the step in flight and reduce it again); the
survivors of a generation holding the same weights; a fallback that says no rank holds the state only when none
lives; every death live recovery answered charged to max_failures. With shards besides: no step run on a shard that
is behind (every shard at the committed step after each gather), each joiner sent its own shard's state, a fallback
that says a shard has no copy left only when no live rank, never replaced, holds that shard, and no step lost by a
live recovery. With planned changes besides: no step thrown away unless a member of its generation was lost or a
generation that is not planned came after it, and no step lost by a move, a leave or a grow (a leave that a death
overtook forms the smaller group unplanned, and may throw the step in flight away, as a shrink does); a rank left
out of the group exits cleanly, and no failure is recorded for its process; a member new to the group (a drained
rank's replacement, a rank a grow added) enters it as a joiner, sent the state by a member that holds it, a moved
rank's replacement with the weights its drained process left with, a grown rank at the newest committed step; a
drained rank counts as gone for a fallback's holders once its drain is answered. With an FSDP2 mesh besides: every
shard a step's gathers and reductions bring together at that step; no generation that renumbers a rank or changes the
world's size (the controller never resizes such a run live); a generation throws one step away at most, a recovery
one step or no more than the deaths that published its generations, and its history says what it cost.

Seeds 0 to 999: 17 drains moved live, 11 left live, 180 fell back (most before the group formed, or while a
recovery was under way), 17 grows live, 24 ranks left out that exited cleanly; no violation in seeds 0 to 9,999.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator

from outlast.protocol.membership import Membership, joined_key, member_name, membership_key, store_prefix
from outlast.protocol.transport import INCARNATION_VAR
from outlast.sim.schedule import LIVE_POINTS
from outlast.train.live import rendezvous
from outlast.train.live.live_rank import LiveRank
from outlast.train.live.rendezvous import NotAMemberError
from outlast.train.live.step_commit import agreed_step
from outlast.train.live.store_host import LiveStore
from outlast.train.torch.live_shards import reports_after_gather

if TYPE_CHECKING:
    from outlast.sim.run import Sim
    from outlast.sim.workers import SimRank

# Where a fault may strike a rank: in forward and backward, before its allreduce, after it (before the vote),
# between its vote and the verdict, after a committed step (before its report), while it waits for a generation,
# while its group forms, and in a transfer, sending or receiving.
POINTS = LIVE_POINTS
POLL_S = 0.01  # a rank's look at the store while it waits for a verdict or a generation
TRANSFER_S = (0.005, 0.3)  # the state's transfer
FORM_TIMEOUT_S = 60.0  # LiveRank's: a group whose member never connects fails to form only then
BROKEN = "broken"
UNHELD = re.compile(r"every rank holding shard\(s\) \[([0-9, ]+)\]")  # LiveRun.unheld's reason, with shards


class MemStore:
    """torch.distributed's store calls the live protocol makes, in memory (values are bytes, as the store's)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def add(self, key: str, n: int) -> int:
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """As the TCPStore's: set when the key holds `expected` (or is absent and `expected` is empty); returns the
        value the key holds after."""
        current = self.data.get(key)
        if (current is None and expected == "") or (current is not None and current == expected.encode()):
            self.data[key] = desired.encode()
            return self.data[key]
        return current if current is not None else expected.encode()


class Prefixed:
    """A view of a store under a prefix, as `torch.distributed.PrefixStore` makes one."""

    def __init__(self, prefix: str, store: MemStore) -> None:
        self.prefix, self.store = prefix, store

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(f"{self.prefix}/{key}", value)

    def get(self, key: str) -> bytes:
        return self.store.get(f"{self.prefix}/{key}")

    def check(self, keys: list[str]) -> bool:
        return self.store.check([f"{self.prefix}/{k}" for k in keys])

    def add(self, key: str, n: int) -> int:
        return self.store.add(f"{self.prefix}/{key}", n)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self.store.compare_set(f"{self.prefix}/{key}", expected, desired)


def live_store() -> LiveStore:
    """The store a simulated driver holds, as the real driver holds its TCPStore."""
    store = MemStore()
    return LiveStore(store, "sim-live:0", lambda attempt: Prefixed(store_prefix(attempt), store))


class Group:
    """One generation's gloo group, as its ranks see it: collectives complete when every rank has reached them, and
    fail on every rank once a member died or left (its sockets closed). A member that died before it connected
    leaves the others waiting in the group's formation until its timeout, as gloo does."""

    def __init__(self, sim: "Sim", membership: Membership, ranks: tuple[int, ...] | None = None) -> None:
        self.sim, self.membership = sim, membership
        # The generation's ranks in it: all of them, or those of one of an FSDP2 mesh's groups (`live_mesh.py`).
        self.ranks = tuple(range(membership.world_size)) if ranks is None else ranks
        self.shards = sim.schedule.loop.shards
        self.broken = False
        self.arrived: dict[str, dict[int, SimRank]] = {}  # a collective's name -> the ranks waiting in it
        self.values: dict[str, dict[int, object]] = {}  # a collective's name -> what each rank brought to it
        self.formed = False
        self.members: dict[int, SimRank] = {}  # those that reached its formation
        self.sending: set[int] = set()  # the senders whose transfer runs
        self.sent: dict[int, Sent] = {}  # a sender's rank -> the state it sends
        sim.world.after(FORM_TIMEOUT_S, self._form_timeout)

    def _form_timeout(self) -> None:
        """A member never connected (it died first, or went on to a newer generation): the formation fails."""
        if not self.formed and not self.broken:
            self._break(0.0)

    def meet(self, w: "SimRank", name: str, value: object = 0) -> None:
        """`w` waits in collective `name`; resumed with the values of all (by rank), or BROKEN."""
        if self.broken:
            self.sim.world.after(0.0, w.resume, BROKEN)
            return
        waiting = self.arrived.setdefault(name, {})
        waiting[w.live.rank_in] = w
        brought = self.values.setdefault(name, {})
        brought[w.live.rank_in] = value
        if name == "form":
            self.members[w.live.rank_in] = w
        if len(waiting) == len(self.ranks):
            del self.arrived[name]
            del self.values[name]
            if name == "form":
                self.formed = True
            values = [brought[r] for r in sorted(brought)]
            for r in waiting.values():
                self.sim.world.after(0.0, r.resume, values)

    def transfer(self, source: "SimRank", sent: "Sent") -> None:
        """`source` sends the state to the joiners it serves (`Membership.sender`: with one shard, every joiner);
        it starts once each of them is receiving, and each is resumed with the state sent (the source with True)."""
        self._wait(source, f"send {source.live.rank_in}")
        self.sent[source.live.rank_in] = sent
        self._maybe_send(source.live.rank_in)

    def receive(self, joiner: "SimRank", sender: int) -> None:
        self._wait(joiner, f"receive {sender}")
        self._maybe_send(sender)

    def _wait(self, w: "SimRank", name: str) -> None:
        if self.broken:
            self.sim.world.after(0.0, w.resume, BROKEN)
        else:
            self.arrived.setdefault(name, {})[w.live.rank_in] = w

    def _maybe_send(self, sender: int) -> None:
        served = [j for j in self.membership.joiners if self.membership.sender(j, self.shards) == sender]
        if self.broken or sender in self.sending or f"send {sender}" not in self.arrived \
                or len(self.arrived.get(f"receive {sender}", {})) < len(served):
            return
        self.sending.add(sender)
        if len(self.sending) == 2:  # joiners of different shards, each sent the state by a holder of its own
            self.sim.facts["live_several_senders"] += 1
        self.sim.world.after(self.sim.world.rng.uniform(*TRANSFER_S), self._sent, sender)

    def _sent(self, sender: int) -> None:
        if self.broken:
            return
        for name, value in ((f"send {sender}", True), (f"receive {sender}", self.sent[sender])):
            for r in self.arrived.pop(name, {}).values():
                self.sim.world.after(0.0, r.resume, value)

    def names(self, member: str) -> bool:
        return (rank := self.membership.rank_of(member)) is not None and rank in self.ranks

    def lost(self, w: "SimRank") -> None:
        """`w` died, or left for a newer generation (its group aborted): once it had connected, every collective
        pending here fails at once; before, the others wait out the formation's timeout."""
        if self.formed or w in self.members.values():
            self._break(0.0)

    def _break(self, delay: float) -> None:
        if self.broken:
            return
        self.broken = True
        waiting = [r for ranks in self.arrived.values() for r in ranks.values()]
        self.arrived.clear()
        for r in waiting:
            self.sim.world.after(delay, r.resume, BROKEN)


@dataclass(frozen=True)
class Sent:
    """What a sender's LiveTraining.state_dict gives a joiner: its own shard's weights (and the optimizer's state
    with them), the other shards as it last gathered them, and its count of reports."""

    shard: int  # which shard's optimizer state it is
    weights: int
    others: dict[int, int]
    reports: int


class LiveSide:
    """A simulated rank's live recovery: the real `LiveRank` over the simulated groups, and the model's weights."""

    def __init__(self, w: "SimRank", store: LiveStore) -> None:
        self.incarnation = int(w.spawn.env.get(INCARNATION_VAR, "0"))
        self.shards, self.mesh = w.loop.shards, w.loop.mesh
        self.rank = LiveRank(Prefixed(store_prefix(w.attempt), store.store), member_name(w.rank, self.incarnation),
                             shards=self.shards, mesh=self.mesh)
        self.rank_in = w.rank
        self.group: Group | None = None
        # The model: the steps applied so far, in order (-1: no state yet), to this rank's own shard (with one
        # shard, to the whole state); and with shards, to each other shard as this rank last gathered it.
        self.weights = -1
        self.others: dict[int, int] = {}
        self.took_state = False  # with shards: its count of reports is its sender's until a step's gather settles it
        # With an FSDP2 mesh (`live_mesh.py`): the rank and world its mesh was made for, which it keeps, and the
        # mesh's groups of the generation it attached last.
        self.mesh_rank, self.mesh_world = w.rank, w.world_size
        self.mesh_groups: list[Group] = []

    @property
    def shard(self) -> int:
        return self.rank_in % self.shards

    def restored(self, step: int) -> None:
        """Its checkpoint restored (steps 0..step-1 applied to every shard), or nothing (step 0)."""
        self.weights = step
        if not self.mesh:  # FSDP2 keeps no copy of the other shards: its forward gathers them every step
            self.others = {s: step for s in range(self.shards) if s != self.shard}

    def gathered(self, pieces: list[int]) -> None:
        """FlatShards.gather: each other shard from its holder in this rank's replica."""
        replica = self.rank_in - self.shard
        self.others = {s: pieces[replica + s] for s in range(self.shards) if s != self.shard}


class LiveWatch:
    """The invariants of live recovery, told by the simulated ranks as they go."""

    def __init__(self, sim: "Sim") -> None:
        self.sim = sim
        self.verdicts: dict[tuple[int, int, int], dict[str, bool]] = {}  # (attempt, generation, step) -> member's
        self.top: dict[int, int] = {}  # attempt -> the highest step any rank applied
        self.replacements = 0
        self.together = 0  # ranks lost with another of their node: the node's loss is one failure
        self.seen_records = 0
        self.moved: dict[tuple[int, int], int] = {}  # (attempt, rank) -> the weights its drained process left with
        self.drained: set[tuple[int, int]] = set()  # (attempt, rank) of the ranks on a node drained
        self.left_pids: list[tuple[int, int, int]] = []  # (attempt, rank, pid) of the processes a generation left out
        self.thrown: dict[int, set[tuple[int, int]]] = {}  # attempt -> the (generation, step) thrown away
        self.shrunk: set[tuple[int, int]] = set()  # (attempt, generation): a smaller world formed unplanned

    def violation(self, text: str) -> None:
        self.sim.observer.violation(text)

    def node_lost(self, ranks: int) -> None:
        self.together += max(0, ranks - 1)

    def started(self, w: "SimRank") -> None:
        """A replacement forked for a death; not a drained rank's, forked while it lives on its draining node (a
        move: no failure), so that the count stays one that the charges must reach."""
        if w.incarnation == 0:
            return
        before = self.sim.live_processes.get((w.run_id, w.attempt, w.rank, w.incarnation - 1))
        self.replacements += before is None or before.node.node_id not in self.sim.drained_at

    def entering(self, w: "SimRank", membership: Membership, rank: int) -> None:
        """A member new to the group (a replacement, a drained rank's, a rank a grow added) enters it as a joiner,
        sent the state by a member that holds it: so a moved rank's state reaches its replacement, and a grown
        rank starts with the survivors' weights."""
        side = w.live
        assert side is not None
        if membership.generation == 0 or side.rank.has_state:
            return
        if rank not in membership.joiners:
            self.violation(f"rank {w.rank} ({side.rank.member}) of attempt {w.attempt}, new to the group, holds no "
                           f"state, and generation {membership.generation} does not name it a joiner: no state "
                           "reaches it")
            return
        sender = membership.members[membership.sender(rank, side.shards)]
        holds = [o.live.rank.has_state for o in self.sim.live_processes.values() if o.attempt == w.attempt
                 and o.live is not None and o.live.rank.member == sender]
        if membership.sender(rank, side.shards) in membership.joiners or holds == [False]:
            self.violation(f"rank {w.rank} ({side.rank.member}) of attempt {w.attempt} is sent the state in "
                           f"generation {membership.generation} by {sender}, which holds none")

    def left(self, w: "SimRank") -> None:
        """`w` was left out of a planned generation (a drained rank moved, or left): it exits cleanly."""
        side = w.live
        assert side is not None
        self.left_pids.append((w.attempt, w.rank, w.pid))
        self.sim.facts["live_left_cleanly"] += 1
        self._moved(w.attempt, w.rank, side.weights)

    def _moved(self, attempt: int, rank: int, weights: int) -> None:
        """A drained rank's weights, and its replacement's as received: whichever comes second, they are the same."""
        key = (attempt, rank)
        if key not in self.moved:
            self.moved[key] = weights
        elif self.moved.pop(key) != weights:
            self.violation(f"rank {rank} of attempt {attempt} moved: its drained process and its replacement hold "
                           f"different weights ({weights} steps, and the other's)")

    def exited(self, w: "SimRank", code: int) -> None:
        """`w` raised SystemExit(code): a rank left out of the group exits cleanly."""
        if code != 0 and (w.attempt, w.rank, w.pid) in self.left_pids:
            self.violation(f"rank {w.rank} of attempt {w.attempt} (pid {w.pid}), left out of the group, exited with "
                           f"code {code}, not cleanly")

    def verdict(self, w: "SimRank", step: int, committed: bool) -> None:
        side = w.live
        generation = side.rank.ledger.generation
        if not committed and not self._aborted_for_cause(w, generation):
            self.violation(f"rank {w.rank} ({side.rank.member}) of attempt {w.attempt}: step {step} thrown away in "
                           f"generation {generation}, though no member was lost: a planned generation threw it")
        if not committed:
            self.thrown.setdefault(w.attempt, set()).add((generation, step))
        seen = self.verdicts.setdefault((w.attempt, generation, step), {})
        seen[side.rank.member] = committed
        if len(set(seen.values())) > 1:
            applied = sorted(m for m, c in seen.items() if c)
            thrown = sorted(m for m, c in seen.items() if not c)
            self.violation(f"attempt {w.attempt}, generation {generation}: step {step} applied by {applied} and "
                           f"thrown away by {thrown}")
        if committed:
            if side.weights != step:
                self.violation(f"rank {w.rank} ({side.rank.member}) of attempt {w.attempt} applied step {step} to "
                               f"weights that had {side.weights} steps applied")
            self.top[w.attempt] = max(self.top.get(w.attempt, -1), step)

    def formed(self, w: "SimRank", membership: Membership, committed: int) -> None:
        side = w.live
        if side.rank.shrinks(membership):
            self.shrunk.add((w.attempt, membership.generation))
        if side.rank_in not in membership.joiners and side.weights != committed + 1:
            self.violation(f"rank {w.rank} ({side.rank.member}) of attempt {w.attempt} holds weights of "
                           f"{side.weights} steps, but generation {membership.generation} agreed on step {committed}")
        if committed < self.top.get(w.attempt, -1):
            self.violation(f"attempt {w.attempt}'s generation {membership.generation} goes on after step {committed}, "
                           f"but step {self.top[w.attempt]} was applied: a committed step was lost")

    @staticmethod
    def _aborted_for_cause(w: "SimRank", generation: int) -> bool:
        """A step is thrown away only when a member of its generation was lost (its group broke) or a generation
        that is not planned was published after it (a death's, a shrink's)."""
        side = w.live
        if any(g.broken for (attempt, gen, _), g in w.sim.live_groups.items()
               if attempt == w.attempt and gen == generation):  # its whole group, or a group of its FSDP2 mesh
            return True
        store, after = side.rank.store, generation
        while store.check([membership_key(after + 1)]):
            after += 1
            if not Membership.from_json(store.get(membership_key(after)).decode()).planned:
                return True
        return False

    def received(self, w: "SimRank", membership: Membership, committed: int, sent: Sent) -> None:
        if sent.shard != w.live.shard:  # FlatShards.load_state_dict refuses it
            self.violation(f"rank {w.rank} of attempt {w.attempt}, holding shard {w.live.shard}, was sent shard "
                           f"{sent.shard}'s state in generation {membership.generation}")
        if w.live.weights != committed + 1:
            self.violation(f"rank {w.rank} of attempt {w.attempt} received weights of {w.live.weights} steps in "
                           f"generation {membership.generation}, which agreed on step {committed}")
        if membership.planned:
            before = self.sim.live_processes.get((w.run_id, w.attempt, w.rank, w.incarnation - 1))
            if before is not None and before.node.node_id in self.sim.drained_at:
                self._moved(w.attempt, w.rank, w.live.weights)
            elif w.incarnation == 0 and committed < self.top.get(w.attempt, -1):
                self.violation(f"rank {w.rank} of attempt {w.attempt}, added by a grow, starts after step {committed}, "
                               f"but step {self.top[w.attempt]} was applied")

    def finished(self, w: "SimRank") -> None:
        if w.live.weights != w.loop.steps:
            self.violation(f"rank {w.rank} of attempt {w.attempt} ended with {w.live.weights} steps applied, of "
                           f"{w.loop.steps}")

    def current(self, w: "SimRank", step: int, when: str) -> None:
        """With shards: every shard this rank holds, its own and those it gathered, has steps 0..step-1 applied, so
        that no step runs on a shard that is behind."""
        side = w.live
        behind = {s: n for s, n in {side.shard: side.weights, **side.others}.items() if n != step}
        if behind:
            self.violation(f"rank {w.rank} ({side.rank.member}) of attempt {w.attempt} {when} at step {step} with "
                           f"shard(s) {behind} (shard: steps applied) behind")

    def mesh_current(self, w: "SimRank", step: int, what: str, told: list[int]) -> None:
        """With an FSDP2 mesh: every shard a step's collective brings together (the replica's, in its gathers; the
        rank's own shard's copies, across the replicas) has steps 0..step-1 applied."""
        if any(n != step for n in told):
            self.violation(f"rank {w.rank} ({w.live.rank.member}) of attempt {w.attempt} {what} at step {step}, "
                           f"and they had {told} steps applied")

    def reshaped(self, w: "SimRank", membership: Membership, rank: int) -> None:
        """An FSDP2 mesh keeps its shape: the controller must not shrink or grow such a run live, nor renumber it."""
        side = w.live
        self.violation(f"attempt {w.attempt}'s generation {membership.generation} numbers rank {w.rank} "
                       f"({side.rank.member}) {rank} of {membership.world_size}, but its FSDP2 mesh was made for rank "
                       f"{side.mesh_rank} of {side.mesh_world}: a run over live_mesh was resized live")

    def after_step(self, records: list) -> None:
        """A fallback that says no rank holds the state, or a shard of it: no rank that was never replaced may live
        with it (with its shard)."""
        for rec in records[self.seen_records:]:
            if rec.path != "restart":
                continue
            if "no rank that holds the state" in rec.reason:
                holders = self._holders(rec.attempt, None)
            elif (unheld := UNHELD.search(rec.reason)) is not None:
                holders = [r for s in unheld.group(1).split(", ") for r in self._holders(rec.attempt, int(s))]
            else:
                continue
            # A drained rank counts as gone once the drain is answered: a death before its replacement took the
            # state falls back, though the drained process, until its deadline, still holds it.
            holders = [r for r in holders if (rec.attempt, r) not in self.drained]
            if holders:
                self.violation(f"attempt {rec.attempt} fell back to a restart ({rec.reason}), while ranks "
                               f"{sorted(holders)}, never replaced, lived with the state")
        self.seen_records = len(records)

    def _holders(self, attempt: int, shard: int | None) -> list[int]:
        """The ranks of `attempt` that live, hold the state (of `shard`, if given) since generation 0 (never replaced
        nor added: the controller learns that a new member took the state only when it reads the sender's word),
        and that the newest generation names (not drained ones that a planned generation moved or left out)."""
        return [w.rank for w in self.sim.observer.live.values() if w.attempt == attempt and w.alive
                and w.live is not None and w.live.incarnation == 0 and w.live.rank.has_state
                and w.live.rank.joins[0].generation == 0 and (shard is None or w.live.shard == shard)
                and _named(w)]

    def at_end(self, book) -> None:
        """Every death live recovery answered (a replacement forked for it) is charged to max_failures (the ranks
        of one lost node together as one), and a live recovery lost no step (the survivors keep the one in flight),
        but a shrink, which throws that step away: one."""
        fell_back = {r.attempt for r in book.state.live_recoveries if r.path == "restart"}
        for attempt, rank, pid in self.left_pids:
            if attempt in fell_back:  # torn down the usual way since: what its node's end records is the restart's
                continue
            charged_for = [f for a in book.state.attempts if a.attempt == attempt for f in a.failures
                           if f.rank == rank and f.pid == pid]
            if charged_for:
                self.violation(f"rank {rank} of attempt {attempt} (pid {pid}) exited cleanly, left out of a planned "
                               f"generation, but its exit was charged as a failure: {charged_for[0].describe()}")
        charged = book.state.failure_counts.get("worker", 0)
        if charged < self.replacements - self.together:
            self.violation(f"{self.replacements} ranks replaced ({self.together} of them lost with another rank of "
                           f"their node), but only {charged} failures charged to max_failures")
        if self.sim.schedule.loop.mesh:
            self._mesh_at_end(book)
            return
        for rec in book.state.live_recoveries:
            # A recovery one of whose generations is a smaller world formed unplanned throws the step in flight away
            # (the lost ranks' batches of it are gone): a shrink, a drained rank's leave that a death overtook (the
            # leaving process's own included), a recovery a lost node widened into a shrink. A sharded world never
            # shrinks. A planned change, nothing else.
            before = max((o.generation for o in book.state.live_recoveries if o.attempt == rec.attempt
                          and o.path == "live" and o.time < rec.time), default=0)
            shrank = any((rec.attempt, g) in self.shrunk for g in range(before + 1, rec.generation + 1))
            allowed = 1 if shrank and self.sim.schedule.loop.shards == 1 else 0
            if rec.path == "live" and rec.steps_lost > allowed:
                self.violation(f"attempt {rec.attempt}'s live recovery of ranks {rec.ranks} lost {rec.steps_lost} "
                               f"steps (at most {allowed})")


    def _mesh_at_end(self, book) -> None:
        """With an FSDP2 mesh: no resize live; each death cost at most one step (the step in flight, or the next one
        when the rank died after a step committed): a generation throws one step away at most, and a recovery no
        more than the deaths that published its generations (a drained node's, lost before its move ended, besides);
        and each live recovery's history says what it cost,
        the steps thrown away since the recovery before it."""
        for r in book.state.resizes:
            if ", live" in r.reason:
                self.violation(f"attempt {r.attempt} of a run over live_mesh was resized live from {r.from_workers} "
                               f"to {r.to_workers} workers ({r.reason})")
        for attempt, thrown in self.thrown.items():
            twice = sorted(g for g in {g for g, _ in thrown} if len({s for h, s in thrown if h == g}) > 1)
            if twice:
                self.violation(f"attempt {attempt}'s generation(s) {twice} threw more than one step away: {thrown}")
        since: dict[int, int] = {}  # attempt -> the generation the recovery before ended in
        for rec in sorted(book.state.live_recoveries, key=lambda r: (r.attempt, r.generation)):
            if rec.path != "live":
                continue
            after = since.get(rec.attempt, 0)
            thrown = sorted((g, s) for g, s in self.thrown.get(rec.attempt, set()) if after <= g < rec.generation)
            since[rec.attempt] = rec.generation
            planned = [self._membership(rec.attempt, g).planned for g in range(after + 1, rec.generation + 1)]
            # The deaths that published a generation, and a drained node's that died before its move ended (its
            # ranks die with no generation of their own: seed 19718, a drained node lost, then a rank killed).
            deaths = planned.count(False) + (True in planned)
            # A generation of the recovery that formed, and whose sender died before its word: the steps thrown before
            # it are told by no one (the next sender counts from that generation on). Counted, not a violation: see
            # docs/guide/live-recovery.md, "In the simulator".
            unsaid = [g for g in range(after + 1, rec.generation) if self._formed_unsaid(rec.attempt, g)]
            if unsaid and rec.steps_lost < len(thrown):
                self.sim.facts["live_mesh_lost_unsaid"] += len(thrown) - rec.steps_lost
            elif rec.steps_lost != len(thrown) or len(thrown) > deaths:
                self.violation(f"attempt {rec.attempt}'s live recovery of ranks {rec.ranks} (generation "
                               f"{rec.generation}) says {rec.steps_lost} step(s) lost, and the ranks threw away "
                               f"{thrown} (generation, step) since generation {after}, with {deaths} death(s) that "
                               "cost a step")
            self.sim.facts["live_mesh_steps_lost"] += len(thrown)
            self.sim.facts["live_mesh_widened_lost"] += len(thrown) > 1

    def _formed_unsaid(self, attempt: int, generation: int) -> bool:
        """Whether `generation` formed (a rank entered it) and no word of it is in the store."""
        entered = any(j.generation == generation for w in self.sim.live_processes.values()
                      if w.attempt == attempt and w.live is not None for j in w.live.rank.joins)
        store = self.sim.driver.live.store if self.sim.driver is not None and self.sim.driver.live is not None else None
        return entered and store is not None and not store.check([f"{store_prefix(attempt)}/{joined_key(generation)}"])

    def _membership(self, attempt: int, generation: int) -> Membership:
        store = self.sim.driver.live.store if self.sim.driver is not None and self.sim.driver.live is not None else None
        assert store is not None
        return Membership.from_json(store.get(f"{store_prefix(attempt)}/{membership_key(generation)}").decode())


def _named(w: "SimRank") -> bool:
    """Whether the newest generation of `w`'s attempt names it."""
    newest = rendezvous.newest_after(w.live.rank.store, -1)
    return newest is None or newest.rank_of(w.live.rank.member) is not None


def loop(w: "SimRank", first_step: int) -> Generator:
    """The rank's loop with `outlast.train.torch.LiveTraining`: join, then each step reduced, voted on, and applied;
    a step that broke is kept and reduced again once the rank joined the next generation. An FSDP2 model's loop
    is `live_mesh.loop`."""
    sim, side, steps = w.sim, w.live, w.loop.steps
    assert side is not None
    if w.loop.mesh:
        from outlast.sim.live_mesh import loop as mesh_loop

        yield from mesh_loop(w, first_step)
        return
    side.restored(first_step)  # what it restored: steps 0..first_step-1 applied (none, from the start)
    if first_step:
        side.rank.resume_at(first_step)  # LiveTraining.start(step)
    step = yield from _rejoin(w)
    w.core.generation = side.rank.ledger.generation  # LiveTraining tells the session after each join
    kept = False  # this rank holds the gradients of `step` from before it broke: no forward and backward again
    while step < steps:
        if side.shards > 1:
            sim.live_watch.current(w, step, "runs a step")
        if not kept:
            yield from _point(w, "forward")
            yield "sleep", w.loop.step_s * sim.world.rng.uniform(0.9, 1.1)
        if side.rank.regroup_due:
            # LiveTraining.step: the planned generation is formed before the reduction, the gradients kept (computed
            # on the committed state every member holds); a rank it leaves out exits (LiveRank.leave).
            if not (yield from _regroup(w)):
                sim.live_watch.left(w)
                side.rank.leave()
            if side.rank.joins[-1].shrunk:  # a node lost meanwhile: the step goes again on the new split
                kept = False
                continue
            if side.rank.joins[-1].committed + 1 != step:
                sim.observer.violation(f"rank {w.rank} ({side.rank.member}) of attempt {w.attempt} ran step {step}, "
                                       f"and the planned generation went on at step {side.rank.joins[-1].committed + 1}")
        side.rank.begin(step)
        yield from _point(w, "before_allreduce")
        assert side.group is not None
        side.group.meet(w, f"allreduce {step}")
        reduced = (yield "live", None) != BROKEN
        yield from _point(w, "after_allreduce")
        committed = yield from _vote(w, step, reduced)
        if not committed:
            side.rank.keep_in_flight()
            resumed = yield from _rejoin(w)
            w.core.generation = side.rank.ledger.generation
            if resumed != step:
                sim.observer.violation(f"rank {w.rank} ({side.rank.member}) of attempt {w.attempt} kept the gradients "
                                       f"of step {step}, but its generation went on at step {resumed}")
            # A shrink: LiveTraining throws the step away, and runs it again on the new split of the data.
            step, kept = resumed, not side.rank.joins[-1].shrunk
            continue
        kept = False
        side.weights += 1  # optimizer.step(): with shards, on this rank's own shard alone
        if side.shards > 1 and (yield from _gather(w, f"gather {step}", step + 1)):
            side.took_state = False  # its count of reports settled before its first report
        elif side.shards > 1:
            # A rank lost in the gather: the group forms again, and goes on after the step every rank applied.
            resumed = yield from _rejoin(w)
            w.core.generation = side.rank.ledger.generation
            if resumed != step + 1:
                sim.observer.violation(f"rank {w.rank} ({side.rank.member}) of attempt {w.attempt} applied step "
                                       f"{step}, broke in its gather, and its generation went on at step {resumed}")
        yield from _after_commit(w, step)
        step += 1
    if side.rank.regroup_due and not (yield from _regroup(w)):
        # LiveTraining.close: a planned generation due after the last step is formed for its new members' sake; a
        # rank it leaves out returns from the loop all the same.
        side.rank.close()
        return
    sim.live_watch.finished(w)
    if side.shards > 1:
        sim.live_watch.current(w, steps, "finished")


def _regroup(w: "SimRank") -> Generator:
    """LiveTraining._regroup: form the planned generation published meanwhile; False when it leaves this rank out."""
    try:
        yield from _join(w)
    except NotAMemberError:
        return False
    w.core.generation = w.live.rank.ledger.generation
    return True


def _rejoin(w: "SimRank") -> Generator:
    """A join after a step broke (LiveTraining._rejoin): a rank the next generation leaves out (a drained one, whose
    planned generation a death overtook) leaves as after a planned one (LiveRank.leave)."""
    try:
        return (yield from _join(w))
    except NotAMemberError:
        w.sim.live_watch.left(w)
        w.live.rank.leave()


def _gather(w: "SimRank", name: str, step: int) -> Generator:
    """`FlatShards.gather` in collective `name`, the state at `step` (steps 0..step-1 applied): False when the group
    broke in it."""
    side = w.live
    assert side is not None and side.group is not None
    yield from _point(w, "gather")
    side.group.meet(w, name, (side.weights, w.core.reports))
    told = yield "live", None
    if told == BROKEN:
        side.rank.last_break = "the group broke while it gathered the shards"
        return False
    side.gathered([weights for weights, _ in told])
    w.core.reports = reports_after_gather(w.core.reports, [reports for _, reports in told], side.took_state)
    w.sim.live_watch.current(w, step, "gathered the shards")
    return True


def _join(w: "SimRank") -> Generator:
    """`LiveRank.join`, its collectives simulated; returns the step to run next. Raises NotAMemberError, as it does,
    when the newest generation leaves this member out."""
    side, sim = w.live, w.sim
    assert side is not None
    while True:
        yield from _point(w, "awaiting")
        after, deadline = side.rank.ledger.generation, sim.world.now + side.rank.timeout_s
        if not side.rank.joins:
            rendezvous.say_ready(side.rank.store, side.rank.member)  # await_membership's, for a planned generation
        while True:
            membership, after = rendezvous.look_for_membership(side.rank.store, side.rank.member, after,
                                                               spare=not side.rank.joins)
            if membership is not None:
                break
            if sim.world.now > deadline:  # await_membership's timeout
                # A rank killed in the last step after its verdict: the others finished, and its replacement waited
                # for a group that never forms. Its failure is the schedule's doing, charged, and the run restarts.
                # With another rank alive it is no one's doing but the protocol's: charged, and reported.
                if not any(o.alive and o.attempt == w.attempt and o is not w for o in sim.observer.live.values()):
                    sim.observer.harm += 1
                    sim.facts["live_orphaned_replacements"] += 1
                raise _failed(w, TimeoutError(f"member {side.rank.member}: no generation after {after} named it "
                                              f"within {side.rank.timeout_s} s"))
            yield "sleep", POLL_S
        if side.group is not None:
            side.group.lost(w)  # close(): the old group is aborted
            side.group = None
        rank = membership.rank_of(side.rank.member)
        assert rank is not None
        sim.live_watch.entering(w, membership, rank)
        side.rank_in = rank
        group = side.group = sim.live_group(w.attempt, membership)
        yield from _point(w, "forming")
        group.meet(w, "form", side.rank.offered(membership))
        gathered = yield "live", None
        if gathered == BROKEN:
            side.rank.broke(membership, "the group broke while it formed")
            continue
        try:
            committed = agreed_step(dict(enumerate(gathered)), membership.joiners)
        except RuntimeError as e:
            sim.observer.violation(f"rank {w.rank} of attempt {w.attempt}, generation {membership.generation}: {e}")
            raise _failed(w, e) from None
        if sim.world.tracing:
            sim.world.note(f"rank {w.rank} ({side.rank.member}) formed generation {membership.generation} at step "
                           f"{committed}")
        sim.live_watch.formed(w, membership, committed)
        if side.shards > 1:
            step = yield from _form_sharded(w, membership, rank, committed)
        else:
            step = yield from _form_whole(w, membership, rank, committed)
        if step is None:
            continue
        # What LiveTraining._join does once LiveRank.join returned; a break there comes after the rank entered the
        # generation: it waits for the next one.
        if w.loop.mesh:
            from outlast.sim.live_mesh import attach

            if not (yield from attach(w, membership)):
                continue
        elif side.shards > 1 and not (yield from _gather(w, "gather", step)):
            # The shards this rank does not hold may be a step behind: gathered before any step runs on them.
            continue
        return step


def _form_whole(w: "SimRank", membership: Membership, rank: int, committed: int) -> Generator:
    """The rest of `LiveRank._form` with one shard: the source sends the state to the joiners and announces. The
    step to run next, or None when the group broke (join the next)."""
    side, group = w.live, w.live.group
    assert side is not None and group is not None
    if rank == membership.source:
        # LiveTraining's state dict
        group.transfer(w, Sent(side.shard, side.weights, dict(side.others), w.core.reports))
        yield from _point(w, "sending")
        if (yield "live", None) == BROKEN:
            side.rank.broke(membership, "a joiner was lost during the transfer")
            return None
        side.rank.announce(membership, rank)
        return side.rank.entered(membership, rank, committed, 0, 0.0)
    if side.rank.announce(membership, rank) or rank not in membership.joiners:
        return side.rank.entered(membership, rank, committed, 0, 0.0)
    assert membership.source is not None
    if not (yield from _receive(w, membership, committed, membership.source)):
        return None
    return side.rank.entered(membership, rank, committed, 0, 0.0)


def _after_commit(w: "SimRank", step: int) -> Generator:
    """Step `step` committed and applied on this rank: the loop's report of it, when it reports that step (with a
    checkpoint every `checkpoint_every` reports)."""
    yield from _point(w, "committed")
    if (step + 1) % w.loop.report_every == 0:
        every = w.loop.report_every * w.loop.checkpoint_every
        yield from w._report(step, checkpoint=(step + 1) % every == 0)


def _vote(w: "SimRank", step: int, reduced: bool) -> Generator:
    """`LiveRank`'s vote on step `step` (begun): whether to apply it, the verdict every rank gets."""
    side, sim = w.live, w.sim
    assert side is not None and side.rank.votes is not None
    verdict, _ = side.rank.votes.cast(step, reduced)
    yield from _point(w, "voted")
    while verdict is None:
        yield "sleep", POLL_S
        verdict, _ = side.rank.votes.poll(step)
    committed = side.rank.settle(verdict)
    if sim.world.tracing:
        sim.world.note(f"rank {w.rank} ({side.rank.member}) step {step}: {verdict.value}")
    sim.live_watch.verdict(w, step, committed)
    return committed


def _receive(w: "SimRank", membership: Membership, committed: int, sender: int) -> Generator:
    """A joiner takes the state from `sender` (`receive_state`, then `load_state_dict`); False when the group broke
    meanwhile (join the next)."""
    side, group = w.live, w.live.group
    assert side is not None and group is not None
    group.receive(w, sender)
    yield from _point(w, "receiving")
    received = yield "live", None
    if received == BROKEN:
        side.rank.broke(membership, "the source was lost during the transfer")
        return False
    _load(w, received)
    w.sim.live_watch.received(w, membership, committed, received)
    return True


def _form_sharded(w: "SimRank", membership: Membership, rank: int, committed: int) -> Generator:
    """The rest of `LiveRank._form` with shards: each holder of a joiner's shard that `Membership.sender` names
    sends it the state, the joiners receive it, every rank waits until all are done, the source announces. The step
    to run next, or None when the group broke (join the next)."""
    side, group = w.live, w.live.group
    assert side is not None and group is not None
    if any(membership.sender(j, side.shards) == rank for j in membership.joiners):
        group.transfer(w, Sent(side.shard, side.weights, dict(side.others), w.core.reports))
        yield from _point(w, "sending")
        if (yield "live", None) == BROKEN:
            side.rank.broke(membership, "a joiner was lost during the transfer")
            return None
    if rank in membership.joiners and not (yield from _receive(w, membership, committed,
                                                               membership.sender(rank, side.shards))):
        return None
    if membership.joiners:
        group.meet(w, "sent")
        if (yield "live", None) == BROKEN:
            side.rank.broke(membership, "a rank was lost while the others sent the state")
            return None
    side.rank.announce(membership, rank)
    return side.rank.entered(membership, rank, committed, 0, 0.0)


def _load(w: "SimRank", received: Sent) -> None:
    """LiveTraining.load_state_dict: the sender's weights, and its count of reports (continue_reports)."""
    side = w.live
    assert side is not None
    side.weights, side.others, w.core.reports = received.weights, dict(received.others), received.reports
    side.took_state = True


def _point(w: "SimRank", point: str) -> Generator:
    """A fault armed for this point strikes here: the rank's node is drained, a node joins, or the rank is
    SIGKILLed."""
    w.sim.live_planned_at(w, point)
    if w.sim.live_armed_for(w, point):
        yield "die", point
        raise AssertionError("a rank went on after its death")


def _failed(w: "SimRank", e: Exception):
    from outlast.sim.workers import WorkerFailed

    return WorkerFailed(type(e).__name__, str(e))
