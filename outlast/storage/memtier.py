"""The memory tier's decisions: what a node keeps in RAM, where the replica goes, what a restore reads.

Pure: no files, sockets or clocks. The tier store (`outlast/storage/tier_store.py`) carries
out the budget's decisions on a node's files; `choose_peer`, `memory_committed`,
`choose_restore` and `sources` are the placement of replicas, the commit levels and the
restore choice, for whoever keeps a run's checkpoints.

Levels. A checkpoint is committed in *memory* once every rank that wrote files for it has
them on its own node and on a peer in another failure domain: one node or one domain lost
still leaves a copy (`memory_committed`). It is *durable* once it is in `storage_path`. A
restore takes the newest committed checkpoint that still exists, durable or with a live copy
of every rank's files, and says how many steps an older one costs (`choose_restore`).

Budget. Each node keeps at most its budget of bytes (`outlast start --checkpoint-memory`).
To make room it evicts the oldest copies first, and never a copy of a run's newest committed
checkpoint: that one is what a restore after a failure reads. A copy that cannot fit without
it is refused, saying what to raise; storage keeps its own copy either way. A copy being
written counts at its declared size from `begin` on, until `finish` keeps it or `abort` lets
it go (its transfer died): bytes in flight are in the budget, never beside it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


class Level(enum.Enum):
    NONE = "none"
    MEMORY = "memory"  # every rank's files on its node and on a peer in another failure domain
    DURABLE = "durable"  # in storage_path


class SourceKind(enum.Enum):
    LOCAL_MEMORY = "local_memory"
    PEER_MEMORY = "peer_memory"
    STORAGE = "storage"


@dataclass(frozen=True, order=True)
class CopyKey:
    run: str  # the run's key: the same across its drivers and attempts
    checkpoint_dir: str
    rank: int


@dataclass(frozen=True)
class Copy:
    """One rank's files of one checkpoint, held on one node."""

    key: CopyKey
    seq: int  # the run's checkpoint sequence: newer checkpoints have larger ones
    nbytes: int
    stored_at: float  # when it was admitted (the node's clock); the oldest is evicted first
    primary: bool = True  # the rank's own node; False: a replica of a peer's rank
    committed: bool = False


@dataclass(frozen=True)
class Admission:
    admit: bool
    evict: tuple[CopyKey, ...]
    reason: str


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


@dataclass
class TierBook:
    """The copies one node holds and its budget; `plan` decides, `apply` records what was done."""

    budget_bytes: int
    copies: dict[CopyKey, Copy] = field(default_factory=dict)
    in_flight: dict[CopyKey, int] = field(default_factory=dict)  # copies being written: their declared bytes

    def used(self) -> int:
        """Bytes held and bytes being written."""
        return sum(c.nbytes for c in self.copies.values()) + sum(self.in_flight.values())

    def newest_committed(self) -> dict[str, int]:
        """run -> the seq of its newest checkpoint this node knows committed."""
        out: dict[str, int] = {}
        for c in self.copies.values():
            if c.committed and c.seq > out.get(c.key.run, -1):
                out[c.key.run] = c.seq
        return out

    def protected(self, c: Copy) -> bool:
        return c.committed and self.newest_committed().get(c.key.run) == c.seq

    def plan(self, new: Copy) -> Admission:
        """Whether `new` fits, and which copies go first (oldest first, never a newest committed one)."""
        if new.key in self.copies:
            return Admission(True, (), f"{new.key.checkpoint_dir} rank {new.key.rank} is already held")
        if new.nbytes < 0:
            return Admission(False, (), f"{new.key.checkpoint_dir} rank {new.key.rank} declares {new.nbytes} bytes: "
                                        "a size is never negative; refused")
        if new.nbytes > self.budget_bytes:
            return Admission(False, (), (
                f"{new.key.checkpoint_dir} rank {new.key.rank} needs {_size(new.nbytes)}, more than the node's "
                f"whole checkpoint memory ({_size(self.budget_bytes)}); raise `outlast start --checkpoint-memory` "
                "to keep it in memory (it is kept in storage either way)"))
        free = self.budget_bytes - self.used() + self.in_flight.get(new.key, 0)
        if new.nbytes <= free:
            return Admission(True, (), f"fits: {_size(new.nbytes)} of {_size(free)} free")
        newest = self.newest_committed()
        evictable = sorted((c for c in self.copies.values()
                            if not (c.committed and newest.get(c.key.run) == c.seq)),
                           key=lambda c: (c.stored_at, c.seq, c.key))
        evict: list[CopyKey] = []
        for c in evictable:
            if new.nbytes <= free:
                break
            # A run's copies newer than the one coming in are pending commits of that run: the
            # incoming older copy does not push them out.
            if c.key.run == new.key.run and c.seq > new.seq:
                continue
            evict.append(c.key)
            free += c.nbytes
        if new.nbytes <= free:
            names = ", ".join(f"{k.checkpoint_dir} rank {k.rank}" for k in evict)
            return Admission(True, tuple(evict), f"evicts the oldest copies to make room: {names}")
        kept = sorted({f"{c.key.checkpoint_dir}" for c in self.copies.values() if self.protected(c)})
        return Admission(False, (), (
            f"{new.key.checkpoint_dir} rank {new.key.rank} needs {_size(new.nbytes)}; evicting every copy but the "
            f"newest committed ones ({', '.join(kept) or 'none'}) frees only {_size(free)} of the node's "
            f"{_size(self.budget_bytes)}; raise `outlast start --checkpoint-memory` to keep it in memory"))

    def begin(self, new: Copy) -> tuple[Admission, list[Copy]]:
        """Make room for `new`, about to be written: the copies `plan` evicts go now (returned), and its
        declared bytes count as in flight until `finish` holds it or `abort` lets it go. Nothing changes when
        it does not fit, is held already or is being written already (one writer per copy: a second one
        would write over the first's files)."""
        if new.key in self.in_flight and new.key not in self.copies:
            return Admission(False, (), f"{new.key.checkpoint_dir} rank {new.key.rank} is being written already; "
                                        "it is asked again once that transfer ends or times out"), []
        admission = self.plan(new)
        if not admission.admit or new.key in self.copies:
            return admission, []
        gone = self.apply(new, Admission(False, admission.evict, admission.reason))
        self.in_flight[new.key] = new.nbytes
        return admission, gone

    def finish(self, new: Copy) -> tuple[Admission, list[Copy]]:
        """`new` is written: it is held if it still fits (what was evicted for it is gone, and a newer copy
        may have come meanwhile), evicting again as `plan` says; returns the copies evicted. Its bytes are
        no longer in flight either way."""
        admission = self.plan(new)
        self.in_flight.pop(new.key, None)
        if not admission.admit:
            return admission, []
        return admission, self.apply(new, admission)

    def abort(self, key: CopyKey) -> None:
        """A copy being written will not be: its transfer died, or its write failed."""
        self.in_flight.pop(key, None)

    def apply(self, new: Copy, admission: Admission) -> list[Copy]:
        """Record an admission that was carried out; returns the evicted copies."""
        gone = [self.copies.pop(k) for k in admission.evict if k in self.copies]
        if admission.admit:
            self.copies.setdefault(new.key, new)
        return gone

    def mark_committed(self, run: str, checkpoint_dir: str) -> None:
        for key, c in list(self.copies.items()):
            if key.run == run and key.checkpoint_dir == checkpoint_dir and not c.committed:
                self.copies[key] = Copy(c.key, c.seq, c.nbytes, c.stored_at, c.primary, True)

    def drop(self, key: CopyKey) -> Copy | None:
        """A copy found gone or corrupt, or freed with its run."""
        return self.copies.pop(key, None)


@dataclass(frozen=True)
class PeerCandidate:
    node_id: str
    failure_domain: str = ""  # "" : the node is a domain of its own
    alive: bool = True
    draining: bool = False


@dataclass(frozen=True)
class PeerChoice:
    node_id: str | None
    reason: str


def domain_of(node: PeerCandidate) -> str:
    return node.failure_domain or f"node:{node.node_id}"


def choose_peer(node_id: str, nodes: Sequence[PeerCandidate], exclude: Iterable[str] = ()) -> PeerChoice:
    """The node that keeps the replica of `node_id`'s copies: the next one after it, in node-id order,
    that is alive, not draining and in another failure domain, so that replicas spread evenly."""
    by_id = {n.node_id: n for n in nodes}
    me = by_id.get(node_id, PeerCandidate(node_id))
    excluded = set(exclude)
    ring = sorted(by_id)
    start = ring.index(node_id) + 1 if node_id in by_id else 0
    skipped: list[str] = []
    for n in (by_id[i] for i in ring[start:] + ring[:start]):
        if n.node_id == node_id:
            continue
        why = ("excluded" if n.node_id in excluded else "not alive" if not n.alive
               else "draining" if n.draining else "same failure domain" if domain_of(n) == domain_of(me) else None)
        if why is None:
            return PeerChoice(n.node_id, f"{n.node_id}: the next live node in another failure domain")
        skipped.append(f"{n.node_id} ({why})")
    return PeerChoice(None, f"no peer for {node_id} in another failure domain that is alive and not draining"
                      + (f": {', '.join(skipped)}" if skipped else ": it is the only node"))


def memory_committed(ranks_with_files: Iterable[int], node_of: Mapping[int, str],
                     holders: Mapping[int, Iterable[str]], domain: Mapping[str, str]) -> tuple[bool, str]:
    """Whether every rank with files has a copy on its node and one in another failure domain."""
    missing = []
    for rank in sorted(ranks_with_files):
        home = node_of.get(rank)
        held = set(holders.get(rank, ()))
        home_domain = domain.get(home, f"node:{home}") if home is not None else f"node:{home}"
        if home not in held:
            missing.append(f"rank {rank} has no copy on its node {home}")
        elif not any(domain.get(n, f"node:{n}") != home_domain for n in held - {home}):
            missing.append(f"rank {rank} has no copy outside the failure domain of {home}")
    return (not missing, "every rank's files are on its node and on a peer" if not missing else "; ".join(missing))


@dataclass(frozen=True)
class Candidate:
    """A committed checkpoint, as a restore weighs it."""

    checkpoint_dir: str
    seq: int
    step: int  # reports made by the run when it was saved: the difference of two is steps lost
    level: Level
    ranks_with_files: frozenset[int] = frozenset()


@dataclass(frozen=True)
class RestoreChoice:
    checkpoint_dir: str | None
    level: Level
    steps_lost: int  # reports between the newest committed checkpoint and the one restored
    lost: tuple[str, ...]  # newer committed checkpoints whose every copy of some rank is gone, newest first
    reason: str
    gone: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # each of `lost` -> its ranks held nowhere


def ranks_held_nowhere(c: Candidate, holders: Mapping[tuple[str, int], Iterable[str]], alive: set[str]) -> list[int]:
    """The ranks of `c` with no copy of their files on a live node: one is enough to make it unrestorable
    (a durable checkpoint has storage's copy of every rank)."""
    if c.level is Level.DURABLE:
        return []
    return [r for r in sorted(c.ranks_with_files) if not alive & set(holders.get((c.checkpoint_dir, r), ()))]


def choose_restore(candidates: Iterable[Candidate], holders: Mapping[tuple[str, int], Iterable[str]],
                   live: Iterable[str]) -> RestoreChoice:
    """The newest committed checkpoint that still exists: durable, or a live copy of every rank's files.

    `holders[(checkpoint_dir, rank)]` are the nodes that hold that rank's files; only `live` ones count.
    """
    alive = set(live)
    ordered = sorted(candidates, key=lambda c: c.seq, reverse=True)
    lost: list[str] = []
    gone: dict[str, tuple[int, ...]] = {}
    for c in ordered:
        if c.level is Level.NONE:
            continue
        missing = ranks_held_nowhere(c, holders, alive)
        if missing:
            lost.append(c.checkpoint_dir)
            gone[c.checkpoint_dir] = tuple(missing)
            continue
        where = "storage" if c.level is Level.DURABLE else "memory"
        steps = ordered[0].step - c.step
        why = (f"{c.checkpoint_dir}, the newest committed checkpoint, from {where}" if not lost else
               f"{c.checkpoint_dir} from {where}: every copy of some rank's files of {', '.join(lost)} is gone "
               f"with its nodes, which costs {steps} steps")
        return RestoreChoice(c.checkpoint_dir, c.level, steps, tuple(lost), why, gone)
    steps = ordered[0].step if ordered else 0
    return RestoreChoice(None, Level.NONE, steps, tuple(lost),
                         "no committed checkpoint exists" if not lost else
                         f"every copy of {', '.join(lost)} is gone and none is durable: the run starts over, "
                         f"which costs {steps} steps", gone)


@dataclass(frozen=True)
class Source:
    kind: SourceKind
    node_id: str = ""


def sources(local_node: str, holders: Iterable[str], durable: bool) -> list[Source]:
    """Where one rank's restore looks, in order: this node's RAM, a peer's RAM, storage."""
    held = set(holders)
    out = [Source(SourceKind.LOCAL_MEMORY, local_node)] if local_node in held else []
    out += [Source(SourceKind.PEER_MEMORY, n) for n in sorted(held - {local_node})]
    if durable:
        out.append(Source(SourceKind.STORAGE))
    return out
