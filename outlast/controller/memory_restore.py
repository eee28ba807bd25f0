"""What a new attempt restores: the latest committed checkpoint still whole, its manifest read from storage
(`read_restorable`), and, for one kept in memory, the copies its nodes pull first (`pull_then`).

One decision, `memtier.choose_restore`, says which committed checkpoint still exists: durable, or
a copy of every rank's files on a node that lives. The controller asks it with the history's
record of who holds each rank's files (`CheckpointRecord.memory_ranks`, kept as the tiers answer
and as nodes pull copies) and the nodes it can still reach, both to skip the checkpoints lost
with their nodes and to choose the one restored: one node of some rank alive is not enough when
every holder of another rank is gone. Each checkpoint skipped says which rank's files went with
which nodes, and what going back costs (`SkippedCheckpoint.steps_lost`).
"""

from __future__ import annotations

import logging

from outlast.controller import effects as fx
from outlast.controller.commits import MEMORY
from outlast.controller.commits.holds import REPLICA_TIMEOUT_S
from outlast.controller.core_state import CoreState, Pull, RestoreRead, Restoring
from outlast.controller.group import Effect, Spawn
from outlast.controller.types import AttemptState
from outlast.protocol import messages as m
from outlast.storage.memtier import Candidate, Level, RestoreChoice, choose_restore, ranks_held_nowhere
from outlast.storage.records import AttemptRecord, CheckpointRecord

log = logging.getLogger("outlast.controller")


# ---- the decision's inputs, from the history ---------------------------------------------------


def reports_at(records: list[CheckpointRecord], attempts: list[AttemptRecord]) -> dict[str, int]:
    """Checkpoint -> the reports the run had made when it was saved, across attempts: an attempt's reports
    count from the checkpoint it restored (report indices start again with each attempt). One whose restored
    checkpoint the history no longer names counts from 0."""
    by_dir = {r.checkpoint_dir: r for r in records}
    restored = {a.attempt: a.restored_from for a in attempts}
    out: dict[str, int] = {}

    def at(r: CheckpointRecord, depth: int) -> int:
        if r.checkpoint_dir not in out:
            base = by_dir.get(restored.get(r.attempt) or "")
            # An attempt restores a checkpoint of an earlier one; the depth bound guards a history edited by hand.
            before = at(base, depth + 1) if base is not None and base.attempt < r.attempt and depth < 1000 else 0
            out[r.checkpoint_dir] = before + r.report_index + 1
        return out[r.checkpoint_dir]

    for r in records:
        at(r, 0)
    return out


def candidates(records: list[CheckpointRecord], attempts: list[AttemptRecord]) -> tuple[
        list[Candidate], dict[tuple[str, int], list[str]]]:
    """The history's committed checkpoints as `choose_restore` weighs them, and who holds each rank's files.
    A record of an older version names its nodes only: any of them counts for every rank, as it did then."""
    steps = reports_at(records, attempts)
    out, holders = [], {}
    for r in records:
        by_rank = r.memory_ranks or {0: r.memory}
        for rank, nodes in by_rank.items():
            holders[(r.checkpoint_dir, rank)] = list(nodes)
        out.append(Candidate(r.checkpoint_dir, r.seq, steps[r.checkpoint_dir],
                             Level.DURABLE if r.durable else Level.MEMORY, frozenset(by_rank)))
    return out, holders


def live_nodes(c: CoreState) -> set[str]:
    """The nodes whose copies can still be asked for: alive in the table, and not lost by this driver (an
    agent started again counts: it reclaimed its copies)."""
    return {n for n in c.nodes.nodes if c.nodes.reachable(n)}


def restore_choice(c: CoreState) -> RestoreChoice:
    found, holders = candidates(c.book.state.checkpoints, c.book.state.attempts)
    return choose_restore(found, holders, live_nodes(c))


def restorable(c: CoreState, checkpoint_dir: str) -> bool:
    """Whether every rank's files of a committed checkpoint are durable or on a live node now."""
    found, holders = candidates(c.book.state.checkpoints, c.book.state.attempts)
    alive = live_nodes(c)
    return any(x.checkpoint_dir == checkpoint_dir and not ranks_held_nowhere(x, holders, alive) for x in found)


# ---- carrying it out ---------------------------------------------------------------------------


def skip_lost(c: CoreState) -> str | None:
    """Skip (recorded, with what each costs) every committed checkpoint newer than the newest restorable one;
    return that one, or None (the run starts over)."""
    choice = restore_choice(c)
    if not choice.lost:
        return choice.checkpoint_dir
    steps = reports_at(c.book.state.checkpoints, c.book.state.attempts)
    back_to = steps.get(choice.checkpoint_dir or "", 0)
    for name in choice.lost:
        record = c.book.committed(name)
        assert record is not None
        lost = steps[name] - back_to
        why = _why_lost(c, record, choice.gone[name], choice.checkpoint_dir, lost)
        c.book.skip_checkpoint(name, why, c.wall(), steps_lost=lost)
        log.warning("checkpoint %s cannot be restored (%s)", name, why)
    log.warning("restoring %s: %s", choice.checkpoint_dir or "no checkpoint (the run starts over)", choice.reason)
    return choice.checkpoint_dir


def _why_lost(c: CoreState, record: CheckpointRecord, ranks: tuple[int, ...], back_to: str | None,
              lost: int) -> str:
    how = ("CheckpointConfig(checkpoint_storage='memory')" if c.plan.checkpoint_storage == MEMORY else
           "a drain's checkpoint whose upload from memory was not in yet")
    held = record.memory_ranks or {0: record.memory}
    whose = "; ".join(
        (f"rank {r}'s files{_files(c, record.checkpoint_dir, r)} were on " if record.memory_ranks else
         "its files were on ") + (", ".join(held.get(r, [])) or "no node") for r in ranks)
    cost = (f"going back to {back_to} costs the {lost} reports between them" if back_to is not None else
            f"the run starts over: going back costs every step so far (the {lost} reports made up to it)")
    return f"it was kept in memory only ({how}): {whose}, and every one of those nodes is gone; {cost}"


def _files(c: CoreState, checkpoint_dir: str, rank: int) -> str:
    names = c.rank_files.get(checkpoint_dir, {}).get(rank, [])
    if not names:
        return ""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f" ({shown})"


def note_pulled(c: CoreState, checkpoint_dir: str, node: str, rank: int) -> None:
    """A node that pulled a rank's copy holds it too: once the nodes that held it first are gone, it is there."""
    record = c.book.committed(checkpoint_dir)
    if record is None:
        return
    by_rank = {r: list(ns) for r, ns in (record.memory_ranks or {rank: record.memory}).items()}
    if node not in by_rank.setdefault(rank, []):
        by_rank[rank].append(node)
        c.book.note_memory(checkpoint_dir, by_rank, None)


def _holders(c: CoreState, restore: str, rank: int) -> list[str]:
    """The nodes reachable now that hold the rank's files, those not draining first."""
    record = c.book.committed(restore)
    by_rank = (record.memory_ranks or {rank: record.memory}) if record is not None else {}
    draining = {n.node_id for n in c.nodes.nodes.values() if n.state == "draining"}
    return sorted((n for n in by_rank.get(rank, []) if c.nodes.reachable(n) and c.nodes.tier_of(n)),
                  key=lambda n: (n in draining, n))


def _sources(c: CoreState, restore: str, node: str, rank: int) -> list[str]:
    held = _holders(c, restore, rank)
    if held:
        # A node's own copy is checked before it is trusted: with another holder it asks, and keeps its own if
        # whole.
        return [s for s in held if s != node] if node not in held or len(held) > 1 else []
    # No holder of this rank answers now: the table may lag an agent started again with its copies. The
    # checkpoint's other holders are asked, and a refusal asks again among the rank's holders reachable then.
    record = c.book.committed(restore)
    return sorted(n for n in (record.memory if record is not None else []) if n != node and c.nodes.reachable(n)
                  and c.nodes.tier_of(n))


def pull_then(c: CoreState, a: AttemptState, sends: list[Effect]) -> None:
    """Each node of the attempt first pulls, from a node that holds the checkpoint it restores in memory, the
    files of every rank it lacks (`TierPull`); its ranks are started once every pull has answered, kept or not.
    So a restore reads this node's RAM, then a peer's, then storage (which a "memory" run lacks), each copy
    checked against its record: the node's own copy before a pull counts (a corrupt one is dropped and fetched
    again), the pulled one as it is kept, and the restore checks the manifest's checksums once more."""
    if a.restore is None:
        c.out += sends
        return
    restore: str = a.restore
    record = c.book.committed(restore)
    ranks = sorted(a.restore_ranks or ())
    nodes = sorted({n for n in a.placement.values() if c.nodes.tier_of(n)})
    todo = [(node, rank, _sources(c, restore, node, rank)) for node in nodes for rank in ranks]
    todo = [t for t in todo if t[2]]
    if not todo:
        c.out += sends
        return
    c.out += [e for e in sends if not isinstance(e, Spawn)]  # the agents know the run meanwhile
    restoring = Restoring(a, restore, [e for e in sends if isinstance(e, Spawn)], set(range(len(todo))),
                          "storage" if record is not None and record.durable else "no copy: the restore fails")
    for i, (node, rank, sources) in enumerate(todo):
        _pull(c, Pull(restoring, i, node, rank, tuple(sources), frozenset()))


def _pull(c: CoreState, pull: Pull) -> None:
    src = pull.sources[0]
    msg = m.TierPull(run=c.run_key, checkpoint_dir=pull.restoring.checkpoint_dir, rank=pull.rank,
                     from_address=c.nodes.tier_of(src))
    c.ask_tier(pull.node, c.nodes.tier_of(pull.node), msg,
               Pull(pull.restoring, pull.number, pull.node, pull.rank, pull.sources, pull.tried | {src}),
               REPLICA_TIMEOUT_S)


def on_pulled(c: CoreState, pull: Pull, e: fx.TierAnswered) -> None:
    r, node, rank = pull.restoring, pull.node, pull.rank
    restore = r.checkpoint_dir
    stored = e.reply if isinstance(e.reply, m.TierStored) else None
    if stored is not None and stored.skipped:
        # The node's own copy did not match its record: passed over for the peer's, and said.
        text = f"restoring {restore}: {stored.skipped}"
        if c.book.note_once(text, c.wall()):
            log.warning("%s", text)
    if stored is None or not stored.ok:
        # The next holder: one named at placement, else one reachable since (an agent started again
        # with its copies while this pull waited).
        rest = list(pull.sources[1:]) or [n for n in _holders(c, restore, rank) if n != node and n not in pull.tried]
        if rest and c.attempt is r.attempt:
            _pull(c, Pull(r, pull.number, node, rank, tuple(rest), pull.tried))
            return
    if stored is not None and stored.ok:
        note_pulled(c, restore, node, rank)
    if stored is None or not stored.ok:
        log.info("node %s has no copy in memory of %s rank %d (%s); that rank's files come from %s",
                 node, restore, rank, stored.reason if stored is not None else e.error, r.then)
    r.left.discard(pull.number)
    if not r.left and c.attempt is r.attempt:
        c.out.extend(r.spawns)


# ---- what a new attempt restores, read from storage -----------------------------------------------


def read_restorable(c: CoreState, a: AttemptState) -> bool:
    """Ask storage for the latest committed checkpoint whose manifest is still readable; others are skipped (and
    recorded). Its answer goes to `lifecycle.on_manifests_read`. False: there is none, the attempt starts over.

    Only the manifests are read; the workers check the files against them when they fetch them.
    """
    latest = skip_lost(c)  # those kept in memory only whose every copy of some rank is gone
    if latest is None:
        return False
    # Older ones, in case its manifest cannot be read: only those that every rank can still get.
    rest = [r.checkpoint_dir for r in sorted(c.book.state.checkpoints, key=lambda r: -r.seq)
            if r.checkpoint_dir != latest and restorable(c, r.checkpoint_dir)]
    candidates = (latest, *rest)
    effect_id = c.ask_storage(lambda i: fx.ReadManifests(i, candidates))
    c.restore_reads[effect_id] = RestoreRead(a, c.book.state.latest_checkpoint)
    return True
