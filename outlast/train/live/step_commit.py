"""Whether a step is applied, from its votes: the pure core of live recovery's step bookkeeping.

A step's gradients are reduced, then each rank votes: "reduced" if its allreduce returned, "broken"
if it raised. The first verdict written for a step is the only one (the store's compare-and-set
makes it so), and every rank that lives applies the optimizer step exactly when the verdict is
COMMIT. So no rank applies a step that another living rank throws away. A rank that dies after
voting does not matter: its replacement takes the state from a survivor.

COMMIT needs every rank's "reduced" vote; one "broken" vote, or a newer generation published
while the vote was open, makes it ABORT. A newer generation that is planned (a drained rank moved,
ranks added: every member of this one lives) throws no step away: the step is committed as
REGROUP, and every rank forms that generation before its next step, all after the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class StepVerdict(Enum):
    COMMIT = "commit"
    ABORT = "abort"
    REGROUP = "regroup"  # committed, and a newer generation was published: form it before the next step

    @property
    def applied(self) -> bool:
        return self is not StepVerdict.ABORT


@dataclass(frozen=True)
class Tally:
    """What a rank does once its vote is counted: write `verdict` (None: write nothing and wait
    for the verdict another rank or the end of the generation writes), and why."""

    verdict: StepVerdict | None
    reason: str


def tally(reduced: bool, votes_counted: int, world_size: int, newer_generation: bool = False) -> Tally:
    """`votes_counted`: "reduced" votes including this rank's, when `reduced`. `newer_generation`: one was
    published by the time the last vote came; the ranks move to it after this step, all after the same one."""
    if not reduced:
        return Tally(StepVerdict.ABORT, "this rank's allreduce raised: a peer is gone")
    if votes_counted >= world_size and newer_generation:
        return Tally(StepVerdict.REGROUP, f"all {world_size} ranks reduced the step, and a newer generation "
                                          "was published: the ranks form it before the next step")
    if votes_counted >= world_size:
        return Tally(StepVerdict.COMMIT, f"all {world_size} ranks reduced the step")
    return Tally(None, f"{votes_counted} of {world_size} ranks reduced the step so far")


def while_waiting(newer_generation: bool, planned: bool = False) -> Tally:
    """A rank waiting for a verdict: the controller publishing a newer generation means a member is
    gone, and its vote may never come, so the step is thrown away (unless a COMMIT was written
    first: the compare-and-set returns whichever verdict came first). A planned generation (every
    member of this one lives: a drained rank moving, ranks added) is no such sign: the votes come."""
    if newer_generation and not planned:
        return Tally(StepVerdict.ABORT, "a newer generation was published while the vote was open")
    return Tally(None, "waiting for the verdict")


@dataclass(frozen=True)
class Ledger:
    """A rank's step bookkeeping: `committed` is the last step applied by every living rank (-1:
    none yet), `in_flight` the step being voted on, in generation `generation`."""

    generation: int
    committed: int = -1
    in_flight: int | None = None

    def begin(self, step: int) -> Ledger:
        if self.in_flight is not None:
            raise RuntimeError(f"step {step} began while step {self.in_flight} is still in flight")
        if step != self.committed + 1:
            raise RuntimeError(f"step {step} began after step {self.committed} was committed: steps go one "
                               "at a time, each after the one before it was committed")
        return Ledger(self.generation, self.committed, step)

    def after(self, verdict: StepVerdict) -> Ledger:
        if self.in_flight is None:
            raise RuntimeError("a verdict came with no step in flight")
        committed = self.in_flight if verdict.applied else self.committed
        return Ledger(self.generation, committed, None)

    def regroup(self, generation: int, committed: int) -> Ledger:
        """Into `generation`, at the state of step `committed` (the survivors' own, or the one a
        joiner received)."""
        return Ledger(generation, committed, None)


def agreed_step(committed_by_rank: dict[int, int], joiners: tuple[int, ...]) -> int:
    """The step every survivor of a new generation holds; joiners (-1) take it from the source.
    Survivors that disagree would mean a step applied by some and not others: refuse to go on."""
    kept = {r: c for r, c in committed_by_rank.items() if r not in joiners}
    if not kept:
        raise RuntimeError("no rank of the new generation kept the state")
    if len(set(kept.values())) != 1:
        raise RuntimeError(f"the survivors hold different committed steps {kept}: a step was applied by some "
                           "ranks and not others, so the state cannot be trusted; restart from a checkpoint")
    return next(iter(kept.values()))
