"""A step's votes and its verdict, in the controller's store (`step_commit` decides, this writes).

Keys live under the generation, so a vote of an old generation never counts in a new one.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from outlast.train.live import rendezvous
from outlast.train.live.step_commit import Tally, StepVerdict, tally, while_waiting

if TYPE_CHECKING:
    from torch.distributed import Store


class StepVotes:
    def __init__(self, store: Store, generation: int, world_size: int, poll_s: float = 0.0005) -> None:
        self.store = store
        self.generation = generation
        self.world_size = world_size
        self.poll_s = poll_s

    def _key(self, step: int, what: str) -> str:
        return f"live/g{self.generation}/s{step}/{what}"

    def vote(self, step: int, reduced: bool) -> tuple[StepVerdict, str]:
        """Vote, then return the step's one verdict and why."""
        counted = self.store.add(self._key(step, "reduced"), 1) if reduced else 0
        last = reduced and counted >= self.world_size
        decision = tally(reduced, counted, self.world_size,
                         newer_generation=last and rendezvous.newer_published(self.store, self.generation))
        while True:
            if decision.verdict is not None:
                return self._write(step, decision), decision.reason
            if self.store.check([self._key(step, "verdict")]):
                return StepVerdict(self.store.get(self._key(step, "verdict")).decode()), "written by another rank"
            newer = rendezvous.newest_after(self.store, self.generation)
            decision = while_waiting(newer is not None, planned=newer is not None and newer.planned)
            if decision.verdict is None:
                time.sleep(self.poll_s)

    def _write(self, step: int, decision: Tally) -> StepVerdict:
        """Compare-and-set: the first verdict written stands, whoever wrote it."""
        assert decision.verdict is not None
        written = self.store.compare_set(self._key(step, "verdict"), "", decision.verdict.value)
        return StepVerdict(written.decode())
