"""The batch sampler `prepare_data_loader` gives a DataLoader: this rank's batches of each epoch, from its place.

It gives each rank the rows a DistributedSampler gives it (the whole dataset permuted per epoch by
torch.randperm seeded with seed + epoch, the same on every rank, then dealt in turn: rank r reads rows
r, r + world, ... of that order), but reads none twice: where the length does not divide by the world
size, the last `length % world` rows of the order are left out, where a DistributedSampler would repeat
the first rows. It keeps its place in every checkpoint (`train/data_position.py`): a restored run's
DataLoader goes on at the next batch of the epoch, and at another world size the rest of the epoch is
dealt again between the new ranks. The DataLoader's workers read the rows it names and keep no state of
their own, so the position is all there is to save.

The loop is ahead of what it was handed (a DataLoader's workers prefetch): the wrapper that hands the
batches out (`helpers._DeviceLoader`) says which were handed out, with `handed_out`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator

from outlast.train import data_position as dp
from outlast.train import positions

log = logging.getLogger("outlast.worker")


class EpochBatches:
    """A batch sampler (a DataLoader's `batch_sampler=`): the row indices of each batch of this rank's epoch."""

    def __init__(self, length: int, rank: int, world: int, batch_size: int, shuffle: bool, drop_last: bool,
                 seed: int = 0) -> None:
        if batch_size <= 0:
            raise ValueError(f"prepare_data_loader: the DataLoader's batch_size must be positive, got {batch_size}")
        self.batch_size, self.shuffle, self.drop_last, self.seed = batch_size, shuffle, drop_last, seed
        self._epochs = dp.Epochs(length, rank, world, split=True, strided=True)
        self._asked_epoch: int | None = None
        self._bounds: list[tuple[int, int]] = []
        self._handed = 0  # batches of this walk handed out to the loop
        self._begun: dp.Position | None = None  # where this loader's latest walk began
        self._yielded = 0  # batches of the current plan given to the DataLoader (ahead of the loop, with workers)
        self._regrouped = False  # a live grow dealt the rest again: the walk takes up the new plan

    def set_epoch(self, epoch: int) -> None:
        """As DistributedSampler.set_epoch: the permutation of the epochs that begin from now on."""
        self._asked_epoch = epoch

    def __len__(self) -> int:
        """Batches in an epoch begun afresh (as many on every rank)."""
        least = self._epochs.length // self._epochs.world
        return len(dp.batch_bounds(least, least, self.batch_size, self.drop_last))

    def __iter__(self) -> Iterator[list[int]]:
        positions.restore()
        epoch = self._asked_epoch if self._asked_epoch is not None else self._epochs.next_epoch
        p, _ = self._epochs.begin(False, 0, order_seed=self.seed + epoch if self.shuffle else None)
        self._begun = p
        plan: dp.Position | None = p
        while plan is not None:
            left, least = dp.rows_left(plan)
            self._bounds = dp.batch_bounds(len(left), least, self.batch_size, self.drop_last)
            self._handed = 0
            self._yielded = 0
            for start, end in self._bounds:
                self._yielded += 1
                yield [int(i) for i in left[start:end]]
                if self._regrouped:
                    self._regrouped = False
                    break  # a live grow
            else:
                break  # read to its end
            plan = self._epochs.walk  # this rank's new share, from its start

    def regroup(self, saved: dict[int, dp.Position], rank: int, world: int) -> None:
        """A live grow made this rank `rank` of `world`: the rest of the epoch is dealt again from the old world's
        positions (`saved`). A walk under way goes on with the new share once every batch it gave the DataLoader
        was handed to the loop; one whose DataLoader's workers fetched ahead keeps its old share to the epoch's
        end (the rows fetched ahead would be read twice), and says so."""
        if self._yielded > self._handed:
            log.warning("prepare_data_loader: a live grow to %d ranks deals the rest of epoch %d again only to a "
                        "DataLoader without workers fetching ahead (num_workers=0); this one keeps its share",
                        world, self._epochs.next_epoch - 1)
            return
        self._epochs.regroup(saved, rank, world, random.getrandbits(62))
        self._regrouped = self._epochs.walk is not None

    def handed_out(self) -> None:
        """The loop was handed the walk's next batch."""
        start, end = self._bounds[self._handed]
        self._handed += 1
        self._epochs.took(end - start)

    def walk_ended(self) -> None:
        """The loop read the walk to its end or left it: the next walk is the next epoch."""
        if self._begun is not None:
            self._epochs.end(self._begun)  # only its own: a loader built again since may be reading the next

    def follow(self, earlier: "EpochBatches") -> None:
        """Go on from `earlier`, a loader of the same dataset this one replaces: its epochs and its place."""
        if earlier._epochs.length == self._epochs.length:
            self._epochs = earlier._epochs
            self._asked_epoch = earlier._asked_epoch

    # -- positions.Resumable ---------------------------------------------------------------

    def data_position(self) -> dp.Position:
        return self._epochs.position()

    def resume_from(self, saved: dict[int, dp.Position]) -> None:
        why = self._epochs.resume_from(saved, random.getrandbits(62))
        if why is not None:
            log.warning("prepare_data_loader: epoch %d is read again from its start: %s", self._epochs.next_epoch, why)
