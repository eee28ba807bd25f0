"""What must hold of the memory tier in a schedule whose nodes keep checkpoints in memory, checked as it runs.

- No restore reads a file whose checksum does not match the manifest's, from memory or from storage.
- A checkpoint committed in memory only (`checkpoint_storage="memory"`: its report() returned on every rank)
  is restored while one valid copy of every rank's files lives: no attempt restores an older one then,
  and no rank's restore of it fails for want of its files.
- When every copy of some rank's files of such a checkpoint is gone, the run falls back to the newest one
  that is restorable, and its history says so and what it cost; a checkpoint whose copies live is never
  skipped as held nowhere.
- No node's budget evicts a copy of the run's newest committed checkpoint.

A copy lives while its node's machine does and its bytes match its checksum: a node that died took its RAM
with it, and a persistent agent started again has reclaimed its node's copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from outlast.protocol import messages as m
from outlast.sim.tier import check, check_all
from outlast.storage.memtier import Copy, CopyKey

if TYPE_CHECKING:
    from outlast.sim.run import Sim
    from outlast.sim.workers import SimRank


class TierWatch:
    def __init__(self, sim: "Sim") -> None:
        self.sim = sim
        self.memory_only = sim.schedule.tier is not None and sim.schedule.tier.checkpoint_storage == "memory"
        self.written: dict[str, dict[int, m.FileEntry]] = {}  # checkpoint -> rank -> the file it wrote
        # Skips checked, each in the step that made it: a driver launched later finds the earlier drivers' skips in
        # the history, made while their copies' nodes were gone, and a copy may have come back since (an agent started
        # again reclaims its copies).
        self._skips_seen: dict[int, int] = {}  # driver generation -> skipped checkpoints seen in its history
        self._skips_judged: set[tuple[str, float]] = set()  # (checkpoint, when skipped)
        self._spawned_at: dict[int, float] = {}  # attempt -> when its ranks were first spawned
        self._corrupted: list[tuple[float, str, CopyKey]] = []  # when, on which node, which copy

    def violation(self, what: str) -> None:
        self.sim.observer.violation(what)

    @property
    def run(self) -> str:
        return self.sim.storage.uri("run")

    def wrote(self, w: "SimRank", name: str, entry: m.FileEntry) -> None:
        self.written.setdefault(name, {})[w.rank] = entry

    def gone(self, name: str) -> list[int]:
        """The ranks of checkpoint `name` with no valid copy of their files on a live node."""
        out = []
        for rank, entry in sorted(self.written.get(name, {}).items()):
            key = CopyKey(self.run, name, rank)
            if not any(n.tier is not None and n.alive and key in n.tier.data
                       and check_all(n.tier.data[key], [entry]) is None
                       for n in self.sim.nodes if getattr(n, "tier", None) is not None):
                out.append(rank)
        return out

    # ---- restores ------------------------------------------------------------------------------

    def read(self, w: "SimRank", manifest, read: dict[str, bytes], source: str) -> None:
        for entry in manifest.files:
            why = check(read, entry)
            if why is not None:
                self.violation(f"rank {w.rank} of attempt {w.attempt} restored {manifest.checkpoint_dir} from "
                               f"{source} on node {w.node.node_id} reading a file that differs from the manifest: "
                               f"{why}")

    def corrupted(self, node_id: str, key: CopyKey) -> None:
        self._corrupted.append((self.sim.world.now, node_id, key))

    def restore_failed(self, w: "SimRank", name: str, why: str) -> None:
        """Excused: a copy on the rank's node that rotted once its attempt had pulled what it restores (the
        rank's restore reads its own node's memory, and storage holds nothing of a run kept in memory only)."""
        began = self._spawned_at.get(w.attempt, 0.0)
        rotted = any(t >= began and n == w.node.node_id and k.checkpoint_dir == name for t, n, k in self._corrupted)
        if self.memory_only and not rotted and not self.gone(name):
            self.violation(f"rank {w.rank} of attempt {w.attempt} on node {w.node.node_id} could not restore {name} "
                           f"({why}) while a valid copy of every rank's files lives in memory")

    def spawned(self, spawn: m.SpawnWorkers, committed: list[str]) -> None:
        """`committed`: the checkpoints whose report() returned on every rank, oldest first."""
        self._spawned_at.setdefault(spawn.attempt, self.sim.world.now)
        core = self.sim.driver.core if self.sim.driver is not None else None
        skipped = {s.checkpoint_dir: s.reason for s in core.book.state.skipped_checkpoints} if core else {}
        # Those retention let go are no longer the run's to restore: it keeps the newest the history names, which
        # may be one whose report() never returned.
        kept = {r.checkpoint_dir for r in core.book.state.checkpoints} | set(skipped) if core else set(committed)
        newer = [c for c in committed if (spawn.restore_checkpoint is None or c > spawn.restore_checkpoint)
                 and c in kept]
        if not newer:
            return
        if not self.memory_only:
            self.violation(f"attempt {spawn.attempt} restores {spawn.restore_checkpoint}, older than "
                           f"{newer[-1]}, whose report() returned on every rank")
            return
        # One skipped was judged when it was (`after_step`, `restore_failed`): a copy may have come back since.
        living = [c for c in newer if c not in skipped and not self.gone(c)]
        if living:
            self.violation(f"attempt {spawn.attempt} restores {spawn.restore_checkpoint}, older than {living[-1]}, "
                           "committed in memory, while a valid copy of every rank's files of it lives")
            return
        if newer[-1] not in skipped:
            self.violation(f"attempt {spawn.attempt} restores {spawn.restore_checkpoint} instead of {newer[-1]}, whose "
                           "copies are gone, and the run's history does not say so")

    def after_step(self, driver) -> None:
        """A checkpoint skipped as held nowhere: it is, and the history says what going back costs."""
        skipped = driver.core.book.state.skipped_checkpoints
        seen = self._skips_seen.get(driver.generation, 0)
        self._skips_seen[driver.generation] = len(skipped)
        for s in skipped[seen:]:
            if "kept in memory only" not in s.reason or (s.checkpoint_dir, s.time) in self._skips_judged:
                continue
            self._skips_judged.add((s.checkpoint_dir, s.time))
            if "costs" not in s.reason:
                self.violation(f"{s.checkpoint_dir} was skipped without saying what it costs: {s.reason}")
            if not self.gone(s.checkpoint_dir) and s.checkpoint_dir in self.written:
                self.violation(f"{s.checkpoint_dir} was skipped as held nowhere while a valid copy of every rank's "
                               f"files lives: {s.reason}")

    # ---- budgets ---------------------------------------------------------------------------------

    def evicted(self, node_id: str, copies: list[Copy]) -> None:
        self.sim.facts["evictions"] += len(copies)
        core = self.sim.driver.core if self.sim.driver is not None and self.sim.driver.alive else None
        latest = core.book.state.latest_checkpoint if core is not None else None
        for c in copies:
            if c.key.run == self.run and c.key.checkpoint_dir == latest:
                self.violation(f"node {node_id} evicted its copy of {latest} rank {c.key.rank}, the run's newest "
                               "committed checkpoint")
