"""Live recovery in the simulator: ranks that run the real step-commit protocol against the real controller.

What is real: the controller core with its `LiveRun` (`outlast/controller/live.py`, `live_steps.py`), the store's
side of it (`outlast/train/live/store_host.py`'s `LiveStore`), and on each rank `LiveRank`'s bookkeeping
(`outlast/train/live/live_rank.py`: what it offers a new group, the survivors' agreed step, the announcement, the
ledger) with its votes (`commit_store.StepVotes`, compare-and-set) and its rendezvous (`rendezvous.py`), over an
in-memory store with torch.distributed's store calls. What is simulated: gloo (a group per generation whose
collectives break when a member dies or leaves), the time a transfer takes, and the model's weights, which are a
step count: the steps applied, in order. The faults kill a rank when it next reaches a point of its step
(`POINTS`), so every point is reached on purpose.

`LiveWatch` checks, on every schedule: no step applied by some ranks and thrown away by others; no committed step
lost, and no step's work lost by a live recovery (the survivors keep the step in flight and reduce it again); the
survivors of a generation holding the same weights; a fallback that says no rank holds the state only when none
lives; every death live recovery answered charged to max_failures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generator

from outlast.protocol.membership import Membership, member_name, store_prefix
from outlast.protocol.transport import INCARNATION_VAR
from outlast.sim.schedule import LIVE_POINTS
from outlast.train.live import rendezvous
from outlast.train.live.live_rank import LiveRank
from outlast.train.live.rendezvous import NotAMemberError
from outlast.train.live.step_commit import agreed_step
from outlast.train.live.store_host import LiveStore

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

    def __init__(self, sim: "Sim", membership: Membership) -> None:
        self.sim, self.membership = sim, membership
        self.broken = False
        self.arrived: dict[str, dict[int, SimRank]] = {}  # a collective's name -> the ranks waiting in it
        self.offers: dict[int, int] = {}
        self.formed = False
        self.members: dict[int, SimRank] = {}  # those that reached its formation
        self.sending = False
        self.weights = (-1, 0)
        sim.world.after(FORM_TIMEOUT_S, self._form_timeout)

    def _form_timeout(self) -> None:
        """A member never connected (it died first, or went on to a newer generation): the formation fails."""
        if not self.formed and not self.broken:
            self._break(0.0)

    def meet(self, w: "SimRank", name: str, value: int = 0) -> None:
        """`w` waits in collective `name`; resumed with the values of all (by rank), or BROKEN."""
        if self.broken:
            self.sim.world.after(0.0, w.resume, BROKEN)
            return
        waiting = self.arrived.setdefault(name, {})
        waiting[w.live.rank_in] = w
        if name == "form":
            self.members[w.live.rank_in] = w
            self.offers[w.live.rank_in] = value
        if len(waiting) == self.membership.world_size:
            del self.arrived[name]
            if name == "form":
                self.formed = True
            values = [self.offers[r] for r in range(self.membership.world_size)]
            for r in waiting.values():
                self.sim.world.after(0.0, r.resume, values)

    def transfer(self, source: "SimRank", weights: tuple[int, int]) -> None:
        """The source sends the state to the joiners; it starts once each is receiving, and each is resumed with
        the weights sent (the source with True)."""
        self._wait(source, "send")
        self.weights = weights
        self._maybe_send()

    def receive(self, joiner: "SimRank") -> None:
        self._wait(joiner, "receive")
        self._maybe_send()

    def _wait(self, w: "SimRank", name: str) -> None:
        if self.broken:
            self.sim.world.after(0.0, w.resume, BROKEN)
        else:
            self.arrived.setdefault(name, {})[w.live.rank_in] = w

    def _maybe_send(self) -> None:
        if self.broken or self.sending or "send" not in self.arrived \
                or len(self.arrived.get("receive", {})) < len(self.membership.joiners):
            return
        self.sending = True
        self.sim.world.after(self.sim.world.rng.uniform(*TRANSFER_S), self._sent)

    def _sent(self) -> None:
        if self.broken:
            return
        for name, value in (("send", True), ("receive", self.weights)):
            for r in self.arrived.pop(name, {}).values():
                self.sim.world.after(0.0, r.resume, value)

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


class LiveSide:
    """A simulated rank's live recovery: the real `LiveRank` over the simulated groups, and the model's weights."""

    def __init__(self, w: "SimRank", store: LiveStore) -> None:
        self.incarnation = int(w.spawn.env.get(INCARNATION_VAR, "0"))
        self.rank = LiveRank(Prefixed(store_prefix(w.attempt), store.store), member_name(w.rank, self.incarnation))
        self.rank_in = w.rank
        self.group: Group | None = None
        self.weights = -1  # the model: the steps applied so far, in order (-1: no state yet)


class LiveWatch:
    """The invariants of live recovery, told by the simulated ranks as they go."""

    def __init__(self, sim: "Sim") -> None:
        self.sim = sim
        self.verdicts: dict[tuple[int, int, int], dict[str, bool]] = {}  # (attempt, generation, step) -> member's
        self.top: dict[int, int] = {}  # attempt -> the highest step any rank applied
        self.replacements = 0
        self.together = 0  # ranks lost with another of their node: the node's loss is one failure
        self.seen_records = 0

    def violation(self, text: str) -> None:
        self.sim.observer.violation(text)

    def node_lost(self, ranks: int) -> None:
        self.together += max(0, ranks - 1)

    def started(self, side: LiveSide) -> None:
        self.replacements += side.incarnation > 0

    def verdict(self, w: "SimRank", step: int, committed: bool) -> None:
        side = w.live
        generation = side.rank.ledger.generation
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
        if side.rank_in not in membership.joiners and side.weights != committed + 1:
            self.violation(f"rank {w.rank} ({side.rank.member}) of attempt {w.attempt} holds weights of "
                           f"{side.weights} steps, but generation {membership.generation} agreed on step {committed}")
        if committed < self.top.get(w.attempt, -1):
            self.violation(f"attempt {w.attempt}'s generation {membership.generation} goes on after step {committed}, "
                           f"but step {self.top[w.attempt]} was applied: a committed step was lost")

    def received(self, w: "SimRank", membership: Membership, committed: int) -> None:
        if w.live.weights != committed + 1:
            self.violation(f"rank {w.rank} of attempt {w.attempt} received weights of {w.live.weights} steps in "
                           f"generation {membership.generation}, which agreed on step {committed}")

    def finished(self, w: "SimRank") -> None:
        if w.live.weights != w.loop.steps:
            self.violation(f"rank {w.rank} of attempt {w.attempt} ended with {w.live.weights} steps applied, of "
                           f"{w.loop.steps}")

    def after_step(self, records: list) -> None:
        """A fallback that says no rank holds the state: no rank that was never replaced may live with it."""
        for rec in records[self.seen_records:]:
            if rec.path == "restart" and "no rank that holds the state" in rec.reason:
                holders = sorted(w.rank for w in self.sim.observer.live.values() if w.attempt == rec.attempt
                                 and w.alive and w.live is not None and w.live.incarnation == 0
                                 and w.live.rank.has_state)
                if holders:
                    self.violation(f"attempt {rec.attempt} fell back to a restart ({rec.reason}), while ranks "
                                   f"{holders}, never replaced, lived with the state")
        self.seen_records = len(records)

    def at_end(self, book) -> None:
        """Every death live recovery answered (a replacement forked for it) is charged to max_failures (the ranks
        of one lost node together as one), and a live recovery lost no step (the survivors keep the one in flight),
        but a shrink, which throws that step away: one."""
        charged = book.state.failure_counts.get("worker", 0)
        if charged < self.replacements - self.together:
            self.violation(f"{self.replacements} ranks replaced ({self.together} of them lost with another rank of "
                           f"their node), but only {charged} failures charged to max_failures")
        for rec in book.state.live_recoveries:
            allowed = 1 if rec.cause.startswith("shrink") else 0  # a shrink throws the step in flight away
            if rec.path == "live" and rec.steps_lost > allowed:
                self.violation(f"attempt {rec.attempt}'s live recovery of ranks {rec.ranks} lost {rec.steps_lost} "
                               f"steps (at most {allowed})")


def loop(w: "SimRank", first_step: int) -> Generator:
    """The rank's loop with `outlast.train.torch.LiveTraining`: join, then each step reduced, voted on, and applied;
    a step that broke is kept and reduced again once the rank joined the next generation."""
    sim, side, steps = w.sim, w.live, w.loop.steps
    assert side is not None
    side.weights = first_step  # what it restored: steps 0..first_step-1 applied (none, from the start)
    if first_step:
        side.rank.resume_at(first_step)  # LiveTraining.start(step)
    step = yield from _join(w)
    w.core.generation = side.rank.ledger.generation  # LiveTraining tells the session after each join
    kept = False  # this rank holds the gradients of `step` from before it broke: no forward and backward again
    while step < steps:
        if not kept:
            yield from _point(w, "forward")
            yield "sleep", w.loop.step_s * sim.world.rng.uniform(0.9, 1.1)
        side.rank.begin(step)
        yield from _point(w, "before_allreduce")
        assert side.group is not None
        side.group.meet(w, f"allreduce {step}")
        reduced = (yield "live", None) != BROKEN
        yield from _point(w, "after_allreduce")
        assert side.rank.votes is not None
        verdict, _ = side.rank.votes.cast(step, reduced)
        yield from _point(w, "voted")
        while verdict is None:
            yield "sleep", POLL_S
            verdict, _ = side.rank.votes.poll(step)
        committed = side.rank.settle(verdict)
        if sim.world.tracing:
            sim.world.note(f"rank {w.rank} ({side.rank.member}) step {step}: {verdict.value}")
        sim.live_watch.verdict(w, step, committed)
        if not committed:
            side.rank.keep_in_flight()
            resumed = yield from _join(w)
            w.core.generation = side.rank.ledger.generation
            if resumed != step:
                sim.observer.violation(f"rank {w.rank} ({side.rank.member}) of attempt {w.attempt} kept the gradients "
                                       f"of step {step}, but its generation went on at step {resumed}")
            # A shrink: LiveTraining throws the step away, and runs it again on the new split of the data.
            step, kept = resumed, not side.rank.joins[-1].shrunk
            continue
        kept = False
        side.weights += 1  # optimizer.step()
        yield from _point(w, "committed")
        if (step + 1) % w.loop.report_every == 0:
            every = w.loop.report_every * w.loop.checkpoint_every
            yield from w._report(step, checkpoint=(step + 1) % every == 0)
        step += 1
    sim.live_watch.finished(w)


def _join(w: "SimRank") -> Generator:
    """`LiveRank.join`, its collectives simulated; returns the step to run next."""
    side, sim = w.live, w.sim
    assert side is not None
    while True:
        yield from _point(w, "awaiting")
        after, deadline = side.rank.ledger.generation, sim.world.now + side.rank.timeout_s
        while True:
            try:
                membership, after = rendezvous.look_for_membership(side.rank.store, side.rank.member, after,
                                                                   spare=not side.rank.joins)
            except NotAMemberError as e:
                raise _failed(w, e) from None
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
        if rank == membership.source:
            group.transfer(w, (side.weights, w.core.reports))  # LiveTraining's state dict: the weights, the reports
            yield from _point(w, "sending")
            if (yield "live", None) == BROKEN:
                side.rank.broke(membership, "a joiner was lost during the transfer")
                continue
            side.rank.announce(membership, rank)
            return side.rank.entered(membership, rank, committed, 0, 0.0)
        if side.rank.announce(membership, rank) or rank not in membership.joiners:
            return side.rank.entered(membership, rank, committed, 0, 0.0)
        group.receive(w)
        yield from _point(w, "receiving")
        received = yield "live", None
        if received == BROKEN:
            side.rank.broke(membership, "the source was lost during the transfer")
            continue
        side.weights, reports = received
        w.core.reports = reports  # LiveTraining.load_state_dict: continue_reports
        sim.live_watch.received(w, membership, committed)
        return side.rank.entered(membership, rank, committed, 0, 0.0)


def _point(w: "SimRank", point: str) -> Generator:
    """A fault armed for this point strikes here: the rank is SIGKILLed."""
    if w.sim.live_armed_for(w, point):
        yield "die", point
        raise AssertionError("a rank went on after its death")


def _failed(w: "SimRank", e: Exception):
    from outlast.sim.workers import WorkerFailed

    return WorkerFailed(type(e).__name__, str(e))
