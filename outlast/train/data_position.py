"""Where a rank is in its data: the pure core of exact resume (no I/O; torch only for a DistributedSampler's
permutation, imported when one is drawn).

An epoch of one dataset is read in *generations*. The first splits the epoch's rows between the
ranks; a restore at another world size (or with ranks that took different numbers of rows) ends
the generation and splits what is left of the epoch, the *rest*, between the new ranks. A rank's
position is its epoch, the rows it took of its share in this generation, its shuffle seed, and
the generations before this one (each with every rank's count and seed), so that any rank can
recompute the rest from the positions of all ranks and nothing else: no row index is stored, and
the document stays a few hundred bytes at any dataset size.

A split is *strided* (row i of the rows it splits to rank i % world, as a DistributedSampler deals them;
prepare_data_loader's) or *contiguous* (each rank a range; get_dataset_shard's, whose ranks read their own
blocks of a Ray Data dataset: dealt in turn, every rank would read every block). Either way the first
`len % world` ranks get one row more, and a position's every generation is split by its one rule.

Every row of the epoch's first split is read exactly once in the epoch, through any number of
restores and resizes. The first split drops `length % world` rows, as `shard_indices` always has,
so that every rank takes as many steps (the rows a DistributedSampler would repeat instead, so that every
rank has as many: here none is read twice); a later split keeps them all: the first ranks' shares are
one row longer, and `batch_bounds` folds that row into their last batch, so that every rank still
takes as many steps (with fewer rows left than ranks, those few rows are dropped).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from outlast.protocol.messages import MAX_DATA_POSITION_BYTES

VERSION = 2  # 2: `strided`, and `order_seed` draws torch's permutation (1: numpy's, split in ranges)
MAX_BYTES = MAX_DATA_POSITION_BYTES  # a position document: a few hundred bytes per dataset in practice


Rows = Any  # row indices: a 1-d numpy array, or a range (numpy is imported only where rows are)


class DataPositionError(ValueError):
    """A saved position cannot be used: it names what is wrong with it."""


@dataclass(frozen=True)
class Generation:
    """A split of an epoch that ended: its world size, and each rank's rows taken and shuffle seed."""

    world: int
    taken: tuple[int, ...]
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class Position:
    """One rank's place in one dataset's epoch."""

    epoch: int
    length: int  # the dataset's rows
    split: bool  # False: every rank reads all rows (not in DataConfig.datasets_to_split), as a world of 1
    shuffle: bool
    world: int
    rank: int
    seed: int  # this rank's shuffle seed in this generation
    taken: int = 0  # rows of this rank's order handed out (yielded in a batch) in this generation
    past: tuple[Generation, ...] = field(default=())
    # The whole epoch's rows permuted before the first split, as a DistributedSampler does: torch.randperm
    # with a generator seeded with it, the same on every rank; None: in the dataset's order, each rank
    # shuffling only its own share if `shuffle` (Ray Data's local shuffle).
    order_seed: int | None = None
    strided: bool = False  # each split deals the rows in turn, else in ranges (see the module docstring)

    @property
    def generation(self) -> int:
        return len(self.past)


def first_rows(length: int, world: int, order_seed: int | None = None) -> Rows:
    """The epoch's rows as its first generation splits them: all of them but the last `length % world`. In order
    they are a `range` (which slices as an array does), so that a rank of a large dataset holds no array of them;
    with `order_seed`, DistributedSampler's permutation (`torch.randperm`, seeded with it: its seed + epoch)."""
    if order_seed is None:
        return range(length // world * world)
    import torch

    generator = torch.Generator()
    generator.manual_seed(order_seed)
    return torch.randperm(length, generator=generator).numpy()[:length // world * world]


def shares(rows: Rows, world: int, strided: bool = False) -> list[Rows]:
    """`rows` in `world` shares, the first `len % world` one row longer than the others: rank r's is every
    world-th row from r when `strided`, else a contiguous range."""
    if strided:
        return [rows[r::world] for r in range(world)]
    per, extra = divmod(len(rows), world)
    out, start = [], 0
    for r in range(world):
        end = start + per + (1 if r < extra else 0)
        out.append(rows[start:end])
        start = end
    return out


def order(share: Rows, shuffle: bool, seed: int, window: int | None = None) -> Rows:
    """A rank's rows in the order it reads them: shuffled whole, or with a `window`, each `window` rows in turn
    among themselves (a shuffle that a reader of blocks does with `window` rows held, as Ray's local buffer)."""
    if not shuffle:
        return share
    if window is None or window >= len(share):
        return _rng(seed).permutation(share)
    import numpy as np

    rng = _rng(seed)
    return np.concatenate([rng.permutation(share[s:s + window]) for s in range(0, len(share), window)])


def _rng(seed: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed % 2**64)


def run_seed(storage_path: str, name: str) -> int:
    """The seed every rank of a run shares, from its `(storage_path, name)`: the same in every attempt and after
    the driver is relaunched."""
    return _hash62(f"{storage_path}\0{name}")


def rank_seed(base: int, epoch: int, generation: int, rank: int) -> int:
    """A rank's shuffle seed in one generation of an epoch, from the run's shared seed (`run_seed`): any rank can
    tell any other's, so that a live recovery's replacement reads its share in the order of the rank it replaces."""
    return _hash62(f"{base}/{epoch}/{generation}/{rank}")


def _hash62(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 2


def generation_rows(p: Position, window: int | None = None) -> Rows:
    """The rows the current generation splits: the epoch's first split, less what earlier generations took."""
    import numpy as np

    rows = first_rows(p.length, p.past[0].world if p.past else p.world, p.order_seed)
    for g in p.past:
        parts = shares(rows, g.world, p.strided)
        rows = np.concatenate([order(part, p.shuffle, g.seeds[r], window)[g.taken[r]:] for r, part in enumerate(parts)])
    return rows


def rows_left(p: Position, window: int | None = None) -> tuple[Rows, int]:
    """The rows this rank has left to read in this generation, in order, and the fewest any rank has left
    (`window`: see `order`; a restore must pass the window the saved walk used)."""
    rows = generation_rows(p, window)
    mine = order(shares(rows, p.world, p.strided)[p.rank], p.shuffle, p.seed, window)
    return mine[p.taken:], len(rows) // p.world - p.taken


def batch_bounds(rows_left: int, least_left: int, batch_size: int, drop_last: bool) -> list[tuple[int, int]]:
    """The batches of a rank with `rows_left` rows to read, when the rank with the fewest has `least_left`:
    as many batches on every rank, the last one taking the rank's extra row (see the module docstring)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if least_left <= 0:
        return []
    count = least_left // batch_size if drop_last else -(-least_left // batch_size)
    bounds = [(i * batch_size, (i + 1) * batch_size) for i in range(count)]
    if bounds and not drop_last:
        bounds[-1] = (bounds[-1][0], rows_left)
    return bounds


# -- one reader's epochs -----------------------------------------------------------------


class Epochs:
    """The epochs of one dataset as one rank reads them, a walk at a time: where it is, and where a restore
    puts it. Each walk is one epoch; a walk that ends (read to its end, or left by the loop) makes the next
    walk the next epoch, as on Ray. Pure: the caller draws seeds and does the reading."""

    def __init__(self, length: int, rank: int, world: int, split: bool, strided: bool = False) -> None:
        self.length, self.split, self.strided = length, split, strided
        self.rank, self.world = (rank, world) if split else (0, 1)
        self.next_epoch = 0
        self.walk: Position | None = None  # the epoch a walk is reading (None: no walk under way)
        self.resumed: Position | None = None  # a restored epoch, for the next walk to go on with

    def position(self) -> Position:
        """The epoch being read, a restored one not begun yet, or the start of the next one."""
        if self.resumed is not None:
            return self.resumed
        if self.walk is not None:
            return self.walk
        return Position(self.next_epoch, self.length, self.split, False, self.world, self.rank, 0,
                        strided=self.strided)

    def resume_from(self, saved: dict[int, Position], new_seed: int) -> str | None:
        """Go on from the positions every rank saved; None, or why the saved epoch is read again from its
        start (without every rank's place, as when a rank was lost before it reported, the rest is unknown)."""
        first = saved[min(saved)]
        if first.length != self.length or first.split != self.split:
            self.next_epoch = first.epoch
            return (f"it was saved for {first.length} rows{'' if first.split else ' read whole by every rank'}, "
                    f"and has {self.length}{'' if self.split else ' read whole by every rank'} now")
        try:
            self.resumed = resume(saved, self.rank, self.world, new_seed)
        except DataPositionError as e:
            self.next_epoch = first.epoch
            return str(e)
        self.next_epoch = self.resumed.epoch
        if self.resumed.taken == 0 and not any(any(g.taken) for g in self.resumed.past):
            # At the epoch's start (at any world size): the next walk begins it as any walk does, with its seeds.
            self.resumed = None
        return None

    def begin(self, shuffle: bool, seed: int, order_seed: int | None = None) -> tuple[Position, str | None]:
        """A walk begins: its position, and why a restored epoch is read again from its start (or None).
        `seed` shuffles this rank's share, `order_seed` the whole epoch (see Position)."""
        why = None
        if self.resumed is not None:
            p, self.resumed = self.resumed, None
            if p.shuffle == shuffle:
                self.next_epoch = p.epoch + 1
                self.walk = p
                return p, None
            why = (f"epoch {p.epoch} was saved with{'' if p.shuffle else 'out'} a shuffle and is read "
                   f"with{'' if shuffle else 'out'} one")
        epoch = self.next_epoch
        self.next_epoch = epoch + 1
        self.walk = Position(epoch, self.length, self.split, shuffle, self.world, self.rank, seed if shuffle else 0,
                             order_seed=order_seed, strided=self.strided)
        return self.walk, why

    def regroup(self, saved: dict[int, Position], rank: int, world: int, new_seed: int) -> None:
        """The world changed under the reader (a live-recovery run grew): from now on it is rank `rank` of
        `world`, and the rest of the epoch it is in, from the positions every rank of the old world holds
        (`saved`), is split again between the new ranks, as a restore at another size splits it."""
        if not self.split:
            return
        self.rank, self.world = rank, world
        if self.walk is not None:
            self.walk = resume(saved, rank, world, new_seed)
        elif self.resumed is not None:
            self.resumed = resume(saved, rank, world, new_seed)

    def took(self, rows: int) -> None:
        """The loop was handed `rows` more rows of this walk."""
        assert self.walk is not None
        self.walk = dataclasses.replace(self.walk, taken=self.walk.taken + rows)

    def end(self, walk: Position) -> None:
        """The walk that began at `walk` ended (unless another has begun since)."""
        if self.walk is not None and self.walk.epoch == walk.epoch:
            self.walk = None


# -- across a restore ------------------------------------------------------------------


def resume(saved: dict[int, Position], rank: int, world: int, new_seed: int) -> Position:
    """Rank `rank`'s position at world size `world`, from the positions every rank saved (rank -> position).

    The same world with every rank at the same count goes on in the same generation, each rank where it
    was; anything else ends the generation and splits the rest again, `new_seed` seeding this rank's
    shuffle of its new share."""
    if not saved:
        raise DataPositionError("no rank saved a position")
    first = saved[min(saved)]
    if not first.split:
        # Every rank reads all rows: each goes on from a saved rank's place (its own when it had one).
        mine = saved.get(rank, first)
        return dataclasses.replace(mine, world=1, rank=0)
    expected = set(range(first.world))
    if set(saved) != expected:
        raise DataPositionError(f"the positions of ranks {sorted(expected - set(saved))} of {first.world} are "
                                "missing")
    for r, p in saved.items():
        same = (p.epoch, p.length, p.split, p.shuffle, p.world, p.past, p.order_seed, p.strided)
        if same != (first.epoch, first.length, first.split, first.shuffle, first.world, first.past,
                    first.order_seed, first.strided) or p.rank != r:
            raise DataPositionError(f"rank {r}'s position (epoch {p.epoch}, generation {p.generation}) disagrees "
                                    f"with rank {first.rank}'s (epoch {first.epoch}, generation {first.generation})")
    takens = {p.taken for p in saved.values()}
    if world == first.world and len(takens) == 1:
        return saved[rank]
    ended = Generation(first.world, tuple(saved[r].taken for r in range(first.world)),
                       tuple(saved[r].seed for r in range(first.world)))
    return dataclasses.replace(first, world=world, rank=rank, seed=new_seed, taken=0, past=(*first.past, ended))


# -- the document saved with a checkpoint --------------------------------------------------


def encode(world: int, rank: int, positions: dict[str, Position]) -> str:
    """This rank's positions (dataset key -> position) as the document a checkpoint keeps."""
    doc = {"version": VERSION, "world": world, "rank": rank, "datasets": {
        key: {"epoch": p.epoch, "length": p.length, "split": p.split, "shuffle": p.shuffle, "world": p.world,
              "rank": p.rank, "seed": p.seed, "taken": p.taken, "order_seed": p.order_seed,
              "strided": p.strided,
              "past": [{"world": g.world, "taken": list(g.taken), "seeds": list(g.seeds)} for g in p.past]}
        for key, p in sorted(positions.items())}}
    text = json.dumps(doc, separators=(",", ":"))
    if len(text) > MAX_BYTES:
        raise DataPositionError(f"rank {rank}'s data position is {len(text)} bytes, over {MAX_BYTES}: "
                                f"{len(positions)} datasets, {max(len(p.past) for p in positions.values())} "
                                "generations")
    return text


def decode(text: str, where: str) -> dict[str, Position]:
    """The positions a document holds; `DataPositionError` naming `where` and the fault when it is not one."""
    if len(text) > MAX_BYTES:
        raise DataPositionError(f"{where}: the data position is {len(text)} bytes, over {MAX_BYTES}")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise DataPositionError(f"{where}: the data position is not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        version = doc.get("version") if isinstance(doc, dict) else None
        raise DataPositionError(f"{where}: data position version {version!r}, this outlast reads version "
                                f"{VERSION}: resume with the outlast that saved it, or start the run afresh")
    datasets = doc.get("datasets")
    if not isinstance(datasets, dict):
        raise DataPositionError(f"{where}: the data position has no 'datasets' object")
    out = {}
    for key, d in datasets.items():
        try:
            past = tuple(Generation(_int(g["world"], 1), tuple(_int(t) for t in g["taken"]),
                                    tuple(_int(s) for s in g["seeds"])) for g in d["past"])
            p = Position(_int(d["epoch"]), _int(d["length"]), _bool(d["split"]), _bool(d["shuffle"]),
                         _int(d["world"], 1), _int(d["rank"]), _int(d["seed"]), _int(d["taken"]), past,
                         None if d["order_seed"] is None else _int(d["order_seed"]), _bool(d["strided"]))
        except (KeyError, TypeError, ValueError) as e:
            raise DataPositionError(f"{where}: dataset {key!r}'s position is malformed ({type(e).__name__}: "
                                    f"{e})") from None
        if p.rank >= p.world or any(len(g.taken) != g.world or len(g.seeds) != g.world for g in past):
            raise DataPositionError(f"{where}: dataset {key!r}'s position has ranks outside its world")
        out[str(key)] = p
    return out


def _int(v: object, least: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise ValueError(f"{v!r} is not an integer of at least {least}")
    return v


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{v!r} is not true or false")
    return v
