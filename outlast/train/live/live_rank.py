"""The calls a data-parallel loop makes to outlive the death of any rank.

    live = LiveRank(store, member="w3")
    live.resume_at(restored_step)               # after a restore from a checkpoint (else it starts at 0)
    step = live.join(state_dict, load_state_dict)
    while step < steps:
        grads = ...                             # forward and backward
        while not live.reduce(step, copy_of(grads)):  # summed over the ranks, and the step committed
            live.keep_in_flight()               # a rank died: no rank applies the step; this one keeps its
            live.join(state_dict, load_state_dict)  # gradients and reduces them again with the replacement
        optimizer.step(); step += 1

`join` waits for the next generation the controller publishes, forms its group, checks that every
survivor holds the same committed step, and sends that state to the ranks that joined (or, on a
joiner, receives it). It returns the step to run next: on a survivor, the step that broke; on a replacement, the same step, whose
forward and backward it then runs on its own batch.

A planned generation (a drained rank's replacement, ranks added) breaks nothing: the step in flight
is committed with the verdict REGROUP, and `regroup_due` tells the loop to `join` before its next
reduction, on every rank after the same step. A member left out of it (the drained rank) gets
`NotAMemberError` from that `join`: its replacement holds its rank, and it should exit.

A generation smaller than the one before, with nobody joining, is a shrink (a lost node's ranks left out):
`Joined.shrunk` tells the loop to throw the step in flight away, and the word that the group formed counts it lost.

Ranks that split the optimizer's state in `shards` send each joiner the state from a rank that holds the joiner's
shard (`Membership.sender`): the state a rank gives is its own shard's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from outlast.faults import fault_point
from outlast.protocol.membership import joined_key
from outlast.train.live import rendezvous
from outlast.train.live.commit_store import StepVotes
from outlast.train.live.group import GroupBroken, LiveGroup
from outlast.train.live.state_transfer import receive_state, send_state
from outlast.train.live.step_commit import Ledger, StepVerdict, agreed_step

if TYPE_CHECKING:
    import torch
    from torch.distributed import Store

    from outlast.protocol.membership import Membership


@dataclass(frozen=True)
class Joined:
    """What one `join` did: the generation and rank this member holds, the step it resumes after,
    and the bytes of state it sent or received (0 when none moved) and the seconds that took."""

    generation: int
    rank: int
    world_size: int
    committed: int
    state_bytes: int
    transfer_s: float
    shrunk: bool = False  # a smaller world than the generation before: the step in flight is thrown away


class LiveRank:
    def __init__(self, store: Store, member: str, timeout_s: float = 60.0, shards: int = 1,
                 mesh: bool = False) -> None:
        self.store = store
        self.member = member
        self.timeout_s = timeout_s
        self.shards = shards
        self.mesh = mesh  # an FSDP2 model over live_mesh: told with the word, so that the world is never resized live
        self.ledger = Ledger(generation=-1)
        self.has_state = False
        self.group: LiveGroup | None = None
        self.votes: StepVotes | None = None
        self.last_break: str | None = None
        self.joins: list[Joined] = []
        self.thrown = 0  # steps whose work this rank threw away since the last join: what a recovery cost
        self.regroup_due = False  # the last step was committed as REGROUP: join before the next reduction

    @property
    def rank(self) -> int:
        assert self.group is not None, "join() first"
        return self.group.rank

    def resume_at(self, step: int) -> None:
        """Before the first `join`: the loop restored a checkpoint and goes on at `step` (its steps before are
        committed). Generation 0's ranks then agree on `step - 1`, where without it they would agree on -1 and run
        from step 0 again, on top of the restored state."""
        if self.joins:
            raise RuntimeError(f"resume_at({step}) after this member joined a group: only a loop that just restored a "
                               "checkpoint names where it resumes")
        if step < 0:
            raise ValueError(f"resume_at({step}): a step is 0 or more")
        self.ledger = Ledger(self.ledger.generation, committed=step - 1)

    def join(self, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> int:
        """Into the next generation that names this member; a generation that breaks while it forms
        (another member lost) gives way to the one after it."""
        formed_not: str | None = None
        while True:
            try:
                membership = rendezvous.await_membership(self.store, self.member, self.ledger.generation,
                                                          self.timeout_s, spare=not self.joins)
            except TimeoutError as e:
                if formed_not is None:
                    raise
                # Waiting after a group that failed to form: why it failed is the news.
                raise TimeoutError(f"{e}; generation {self.ledger.generation} failed to form: {formed_not}") from e
            if self.group is not None:
                self.group.close()
                self.group = None
            try:
                return self._form(membership, state_dict, load_state_dict)
            except GroupBroken as e:
                self.broke(membership, str(e))
                formed_not = self.last_break

    def _form(self, membership: Membership, state_dict: Callable[[], Any],
              load_state_dict: Callable[[Any], None]) -> int:
        rank = membership.rank_of(self.member)
        assert rank is not None
        group = LiveGroup.form(self.store, membership.generation, rank, membership.world_size, self.timeout_s)
        self.group = group
        told = group.allgather_ints([self.offered(membership), self.shards])  # one wait for both
        committed = agreed_step(dict(enumerate(offered for offered, _ in told)), membership.joiners)
        self._same_shards(membership, [shards for _, shards in told])
        moved, started = 0, time.monotonic()
        to = [j for j in membership.joiners if membership.sender(j, self.shards) == rank]
        if to:
            state = state_dict()
            for joiner in to:
                moved = send_state(group, state, joiner)
        if rank in membership.joiners:
            state, moved = receive_state(group, membership.sender(rank, self.shards))
            load_state_dict(state)
        if self.shards > 1 and membership.joiners:
            # Several ranks send: the word that the state went across waits until every one of them is done.
            group.allgather_int(0)
        self.announce(membership, rank)
        return self.entered(membership, rank, committed, moved, time.monotonic() - started)

    def _same_shards(self, membership: Membership, shards: list[int]) -> None:
        if len(set(shards)) > 1:
            raise ValueError(f"generation {membership.generation}: the ranks split the optimizer's state in different "
                             f"numbers of shards ({dict(enumerate(shards))}, rank: shards): every rank's LiveTraining "
                             "must be given the same shards=")

    # The steps of `join` and `reduce` between their collectives, apart so that the simulator (`outlast/sim/live.py`)
    # drives the same bookkeeping over collectives of its own.

    def offered(self, membership: Membership) -> int:
        """The committed step this member brings to `membership`'s allgather; a joiner's -1 is ignored: it takes
        what the survivors agree on."""
        return self.ledger.committed if (self.has_state or membership.generation == 0) else -1

    def shrinks(self, membership: Membership) -> bool:
        """Whether `membership` is a smaller world than the one this member was in, unplanned: a shrink (a lost
        node's ranks left out, nobody to replace them). The step in flight is thrown away on every rank: its batches
        go back to the rest of the epoch, which the smaller world splits again. A planned one (a drained node's ranks
        leaving) comes after a committed step, whose batches the loop took from the smaller world's split already."""
        return bool(self.joins) and self.has_state and not membership.planned \
            and membership.world_size < self.joins[-1].world_size

    def announce(self, membership: Membership, rank: int) -> bool:
        """On the rank that sent the state, once it went across, or on every rank when nobody joins: the controller
        learns here that the group formed (generation 0: the loop is live), or that a recovery is over, and what it
        cost. With nobody joining, every rank's word is the same news, and each says it before its first step, so
        no rank's death can reach the controller before the word that the group it died in formed.
        True when this rank announced."""
        if membership.source is not None and rank != membership.source:
            return False
        lost = self.thrown + self.shrinks(membership)
        self.store.set(joined_key(membership.generation), json.dumps({"steps_lost": lost, "wall": time.time(),
                                                                      "shards": self.shards, "mesh": self.mesh}))
        return True

    def entered(self, membership: Membership, rank: int, committed: int, moved: int, transfer_s: float) -> int:
        """`membership` formed with this member holding the state of step `committed`: the step to run next."""
        shrunk = self.shrinks(membership)
        self.has_state = True
        self.thrown = 0
        self.regroup_due = False
        self.ledger = self.ledger.regroup(membership.generation, committed)
        self.votes = StepVotes(self.store, membership.generation, membership.world_size)
        self.joins.append(Joined(membership.generation, rank, membership.world_size, committed, moved, transfer_s,
                                 shrunk))
        return committed + 1

    def broke(self, membership: Membership, why: str) -> None:
        """`membership` broke while it formed: wait for the generation after it."""
        self.last_break = why
        self.ledger = Ledger(membership.generation, self.ledger.committed)

    def reduce(self, step: int, tensors: list[torch.Tensor]) -> bool:
        """Sum `tensors` over the ranks in place, then vote: True when every rank reduced step `step`
        (apply it), False when it broke: no rank applies it (keep its gradients, `keep_in_flight`, and `join`)."""
        assert self.group is not None, "join() first"
        group = self.group
        return self.reduce_by(step, lambda: group.allreduce_sum(tensors))

    def reduce_by(self, step: int, collectives: Callable[[], None]) -> bool:
        """`reduce`, with the step's reductions made by `collectives` (which raises GroupBroken when one fails):
        in groups of the generation's ranks formed beside its whole one, say."""
        assert self.group is not None and self.votes is not None, "join() first"
        self.begin(step)
        fault_point("live.allreduce")  # the others are in the allreduce, waiting for this rank
        try:
            collectives()
            reduced = True
        except GroupBroken as e:
            self.last_break = str(e)
            reduced = False
        return self._vote(step, reduced)

    def vote(self, step: int, reduced: bool) -> bool:
        """For a loop whose gradients were reduced inside its backward (FSDP2's, over `live_mesh`'s groups): vote
        whether they were, on this rank (`reduced`); True when every rank did (apply the step), False when the step
        is thrown away everywhere."""
        assert self.group is not None and self.votes is not None, "join() first"
        self.begin(step)
        return self._vote(step, reduced)

    def _vote(self, step: int, reduced: bool) -> bool:
        assert self.votes is not None
        fault_point("live.vote")  # reduced everywhere, and this rank's vote never comes
        verdict, _ = self.votes.vote(step, reduced)
        return self.settle(verdict)

    def begin(self, step: int) -> None:
        self.ledger = self.ledger.begin(step)

    def settle(self, verdict: StepVerdict) -> bool:
        """The step in flight's verdict: True to apply it."""
        self.ledger = self.ledger.after(verdict)
        self.thrown += verdict is StepVerdict.ABORT
        self.regroup_due = verdict is StepVerdict.REGROUP
        return verdict.applied

    def keep_in_flight(self) -> None:
        """After a step broke (`reduce` returned False): the loop keeps the step's gradients, computed on the state
        every survivor holds, to reduce them again in the next generation. The step broke, but no work is lost."""
        if not self.thrown:
            raise RuntimeError("keep_in_flight() with no step broken since the last join")
        self.thrown -= 1

    def leave(self) -> NoReturn:
        """Left out of the newest generation (`join` raised NotAMemberError after a planned step): the group went on
        without this member, whose rank its replacement holds or the smaller world no longer has. Nothing is left
        for it to do: it exits cleanly (SystemExit(0), which the worker takes as a clean exit and no failure)."""
        self.close()
        raise SystemExit(0)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
