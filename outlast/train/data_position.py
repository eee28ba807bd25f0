"""Where a rank is in its data: the pure core of exact resume (no I/O, no torch).

An epoch of one dataset is read in *generations*. The first splits the epoch's rows between the
ranks; a restore at another world size (or with ranks that took different numbers of rows) ends
the generation and splits what is left of the epoch, the *rest*, between the new ranks. A rank's
position is its epoch, the rows it took of its share in this generation, its shuffle seed, and
the generations before this one (each with every rank's count and seed), so that any rank can
recompute the rest from the positions of all ranks and nothing else: no row index is stored, and
the document stays a few hundred bytes at any dataset size.

Every row of the epoch's first split is read exactly once in the epoch, through any number of
restores and resizes. The first split drops `length % world` rows, as `shard_indices` always has,
so that every rank takes as many steps; a later split keeps them all: the first ranks' shares are
one row longer, and `batch_bounds` folds that row into their last batch, so that every rank still
takes as many steps (with fewer rows left than ranks, those few rows are dropped).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from outlast.protocol.messages import MAX_DATA_POSITION_BYTES

VERSION = 1
MAX_BYTES = MAX_DATA_POSITION_BYTES  # a position document: a few hundred bytes per dataset in practice


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

    @property
    def generation(self) -> int:
        return len(self.past)


def first_rows(length: int, world: int) -> list[int]:
    """The epoch's rows as its first generation splits them: all of them but `length % world`."""
    return list(range(length // world * world))


def shares(rows: list[int], world: int) -> list[list[int]]:
    """`rows` in `world` contiguous shares, the first `len % world` one row longer than the others."""
    per, extra = divmod(len(rows), world)
    out, start = [], 0
    for r in range(world):
        end = start + per + (1 if r < extra else 0)
        out.append(rows[start:end])
        start = end
    return out


def order(share: list[int], shuffle: bool, seed: int) -> list[int]:
    """A rank's rows in the order it reads them."""
    out = list(share)
    if shuffle:
        random.Random(seed).shuffle(out)
    return out


def generation_rows(p: Position) -> list[int]:
    """The rows the current generation splits: the epoch's first split, less what earlier generations took."""
    rows = first_rows(p.length, p.past[0].world if p.past else p.world)
    for g in p.past:
        rows = [row for r, part in enumerate(shares(rows, g.world))
                for row in order(part, p.shuffle, g.seeds[r])[g.taken[r]:]]
    return rows


def my_order(p: Position) -> list[int]:
    """This rank's rows in this generation, in reading order (the first `p.taken` are read already)."""
    return order(shares(generation_rows(p), p.world)[p.rank], p.shuffle, p.seed)


def least_share(p: Position) -> int:
    """The fewest rows any rank has in this generation: the steps every rank takes are counted from it."""
    return len(generation_rows(p)) // p.world


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
        return Position(mine.epoch, mine.length, False, mine.shuffle, 1, 0, mine.seed, mine.taken, mine.past)
    expected = set(range(first.world))
    if set(saved) != expected:
        raise DataPositionError(f"the positions of ranks {sorted(expected - set(saved))} of {first.world} are "
                                "missing")
    for r, p in saved.items():
        same = (p.epoch, p.length, p.split, p.shuffle, p.world, p.past)
        if same != (first.epoch, first.length, first.split, first.shuffle, first.world, first.past) or p.rank != r:
            raise DataPositionError(f"rank {r}'s position (epoch {p.epoch}, generation {p.generation}) disagrees "
                                    f"with rank {first.rank}'s (epoch {first.epoch}, generation {first.generation})")
    takens = {p.taken for p in saved.values()}
    if world == first.world and len(takens) == 1:
        mine = saved[rank]
        return Position(mine.epoch, mine.length, True, mine.shuffle, world, rank, mine.seed, mine.taken, mine.past)
    ended = Generation(first.world, tuple(saved[r].taken for r in range(first.world)),
                       tuple(saved[r].seed for r in range(first.world)))
    return Position(first.epoch, first.length, True, first.shuffle, world, rank, new_seed, 0, (*first.past, ended))


# -- the document saved with a checkpoint --------------------------------------------------


def encode(world: int, rank: int, positions: dict[str, Position]) -> str:
    """This rank's positions (dataset key -> position) as the document a checkpoint keeps."""
    doc = {"version": VERSION, "world": world, "rank": rank, "datasets": {
        key: {"epoch": p.epoch, "length": p.length, "split": p.split, "shuffle": p.shuffle, "world": p.world,
              "rank": p.rank, "seed": p.seed, "taken": p.taken,
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
                         _int(d["world"], 1), _int(d["rank"]), _int(d["seed"]), _int(d["taken"]), past)
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
