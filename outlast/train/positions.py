"""This rank's data positions: written into every report, read back once from the restored checkpoint.

Each report carries the rank's positions (`data_position.encode`) to the controller, which keeps every
rank's beside the checkpoint's metrics in its manifest. The first walk over a dataset after a restore
(or the first report, whichever comes first) reads them back, checks them and hands each dataset the
positions of all the ranks that saved it, so that it can go on where the run was, at any world size.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any, Protocol

from outlast.protocol.transport import LIVE_STORE_VAR
from outlast.train import data_position as dp


class Resumable(Protocol):
    """A dataset or loader that keeps its place: the shards of get_dataset_shard, prepare_data_loader's loaders."""

    def data_position(self) -> dp.Position: ...

    def resume_from(self, saved: dict[int, dp.Position]) -> None: ...


class Follows(Resumable, Protocol):
    """A reader that can go on from an earlier reader of the same source (prepare_data_loader's, built again)."""

    def follow(self, earlier: Any) -> None: ...


_readers: dict[str, Resumable] = {}
_sources: dict[str, tuple[object, Any]] = {}  # key -> (what its reader reads, the reader), for track_for
_saved: Callable[[], dict[int, str]] | None = None  # the restored checkpoint's documents, rank -> text
_restored = False


def track(key: str, reader: Resumable) -> None:
    """Keep `reader`'s place in every checkpoint under `key`; when it was saved, it goes on from there."""
    _readers[key] = reader
    if _restored:
        _resume_one(key, reader, _read_saved())


def track_for(kind: str, source: object, reader: Follows) -> str:
    """Track `reader`, which reads `source`, under its kind's next key ("loader:0", "loader:1", ... in the order
    the sources first come). A reader of a source read before takes the earlier reader's key and place: a loop
    that builds its loader again each epoch goes on as one loader, and its document does not grow."""
    for key, (seen, earlier) in _sources.items():
        if seen is source and key.startswith(kind + ":"):
            reader.follow(earlier)
            break
    else:
        key = f"{kind}:{sum(1 for k in _sources if k.startswith(kind + ':'))}"
    _sources[key] = (source, reader)  # holding `source` keeps its id from being reused
    track(key, reader)
    return key


def start(saved: Callable[[], dict[int, str]] | None) -> None:
    """A new attempt: `saved` reads the positions of the checkpoint it restores (None: it restores none)."""
    global _saved, _restored, _cache
    _readers.clear()
    _sources.clear()
    _saved, _restored, _cache = saved, False, None


def restore() -> None:
    """Hand every tracked reader the positions saved for it, once per attempt."""
    global _restored
    if _restored:
        return
    _restored = True
    saved = _read_saved()
    for key, reader in _readers.items():
        _resume_one(key, reader, saved)


def document(world: int, rank: int) -> str:
    """This rank's positions as a report carries them ("" when it reads no data through outlast)."""
    if not _readers:
        return ""
    restore()
    return dp.encode(world, rank, {key: r.data_position() for key, r in _readers.items()})


def step_start(at_commit: str, now: str) -> str:
    """The positions at the start of the step in flight, from this rank's document when the step before it was
    committed (`at_commit`) and its document now: the first, but for a reader that has begun a walk of a newer
    epoch since, which is at that walk's start (the loop's own state, sent with it, counts that epoch begun)."""
    if not at_commit or not now:
        return at_commit or now
    then = dp.decode(at_commit, "this rank's data position at the last commit")
    current = dp.decode(now, "this rank's data position")
    world, rank = _world_and_rank(now)
    out = {key: (dataclasses.replace(p, taken=0, past=()) if key not in then or p.epoch > then[key].epoch
                 else then[key]) for key, p in current.items()}
    return dp.encode(world, rank, out)


def _world_and_rank(document: str) -> tuple[int, int]:
    """The world size and rank a document was written at (its datasets' are checked by `dp.decode`)."""
    doc = json.loads(document)
    world, rank = doc.get("world"), doc.get("rank")
    if not (isinstance(world, int) and isinstance(rank, int) and 0 <= rank < world):
        raise dp.DataPositionError(f"a data position names rank {rank!r} of world {world!r}: not a rank of a world")
    return world, rank


def shared_seed(context: Any) -> int | None:
    """The seed a rank that shuffles without the loop's seed draws from: the run's (`data_position.run_seed`) under
    live recovery, where a replacement must tell the seed of the rank it replaces; None (at random) otherwise."""
    if not os.environ.get(LIVE_STORE_VAR):
        return None
    return dp.run_seed(context.storage_path, context.experiment_name)


def take_up(document: str, seed: int | None = None) -> list[str]:
    """A rank that replaced a lost one in live recovery goes on where the rank it took the state from was at the
    start of the step it takes up: `document` is that rank's (`document()`, as it stood then). It stands for a
    restored checkpoint's, for every rank of the world it was saved at: the ranks read in lockstep (a batch of the
    same size at each step), so every rank was at the same place of its own share (`everyones`). A rank that joined
    a grown group takes up its place in the split of the larger world the others made before the step (`regroup`),
    as a replacement does. prepare_data_loader's
    loaders deal one order in turn; get_dataset_shard's ranks shuffle their shares each with a seed of its own,
    which every rank can tell from the attempt's shared `seed` (`data_position.rank_seed`) when the loop gave
    none, and is the same on every rank when it did (`local_shuffle_seed` plus the epoch). Returns the keys of the
    readers that cannot be placed so (a seed drawn at random): those begin their epoch again."""
    global _saved, _restored, _cache
    if not document:
        return []
    held = dp.decode(document, "the data position a live recovery's sender held")
    every = {key: everyones(p, seed) for key, p in held.items()}
    kept = {key: ranks for key, ranks in every.items() if ranks is not None}
    world = max((len(ranks) for ranks in kept.values()), default=1)
    docs = {r: dp.encode(world, r, {key: ranks[r] for key, ranks in kept.items() if r in ranks})
            for r in range(world)}
    _saved, _restored, _cache = (lambda: docs), False, None
    return sorted(set(held) - set(kept))


def regroup(document: str, rank: int, world: int, seed: int | None) -> list[str]:
    """A live grow made this rank `rank` of `world`: every tracked reader splits the rest of its epoch again
    between the new ranks, from this rank's own place (`document`, `document()` as it stands at the grow, told to
    every rank of the old world as `take_up` tells it), as the ranks that joined do from the place they were sent.
    Returns the keys of the readers that go on as they were (their other ranks' places cannot be told)."""
    if not document:
        return []
    left = []
    for key, p in dp.decode(document, "this rank's data position").items():
        reader, ranks = _readers.get(key), everyones(p, seed)
        if ranks is None or not hasattr(reader, "regroup"):
            left.append(key)
            continue
        reader.regroup(ranks, rank, world)
    return left


def everyones(p: dp.Position, seed: int | None) -> dict[int, dp.Position] | None:
    """Every rank's place in `p`'s generation, told from one rank's, `p` (the ranks read in lockstep: a batch of
    the same size at each step), or None when a rank's shuffle seed cannot be told (see `take_up`)."""
    if not p.split:
        return None
    out = {}
    for r in range(p.world):
        s = p.seed if p.strided else _seed_of(p, r, seed)
        if s is None:
            return None
        out[r] = dataclasses.replace(p, rank=r, seed=s)
    return out


def _seed_of(p: dp.Position, rank: int, seed: int | None) -> int | None:
    """Rank `rank`'s shuffle seed in `p`'s generation, told from the sender's position `p`: the same as the
    sender's (no shuffle, or the loop's own seed), drawn from the attempt's `seed`, or None (drawn at random)."""
    if not p.shuffle:
        return p.seed
    if seed is None:
        return None  # a seed drawn at random cannot be told from the loop's
    if p.seed == dp.rank_seed(seed, p.epoch, p.generation, p.rank):
        return dp.rank_seed(seed, p.epoch, p.generation, rank)
    if p.generation == 0:
        return p.seed  # the loop's local_shuffle_seed plus the epoch: every rank's
    return None


_cache: dict[str, dict[int, dp.Position]] | None = None


def _read_saved() -> dict[str, dict[int, dp.Position]]:
    """key -> rank -> position, from every rank's document in the restored checkpoint."""
    global _cache
    if _cache is not None:
        return _cache
    out: dict[str, dict[int, dp.Position]] = {}
    for reporter, text in sorted((_saved() if _saved is not None else {}).items()):
        # Keyed by the rank the document names, the rank it held in its world: a live group that shrank numbered
        # its ranks afresh, while the checkpoint names each document by the rank that reported it.
        held = dp.decode(text, f"the data position of rank {reporter}")
        _, rank = _world_and_rank(text)
        for key, p in held.items():
            out.setdefault(key, {})[rank] = p
    _cache = out
    return out


def _resume_one(key: str, reader: Resumable, saved: dict[str, dict[int, dp.Position]]) -> None:
    if key in saved:
        reader.resume_from(saved[key])
