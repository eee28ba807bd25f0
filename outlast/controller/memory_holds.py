"""The controller's half of the memory tier: which node keeps each rank's copy, where its replica goes,
and when a checkpoint is committed in memory.

Every request to a node's tier is an effect (`effects.TierAsk`), its answer an event
(`TierAnswered`); the loop never waits on a copy. Two ways to commit, the run's choice
(`CheckpointConfig(checkpoint_storage=...)`):

- "storage" (the default): the manifest is written as always, and at the same time each rank's node
  copies that rank's files into its memory. The ranks hear `Committed` once the manifest is written
  and every such copy has answered (kept or refused), so the worker's own directory is no longer
  needed; each copy kept then goes to a peer in another failure domain, off the commit.
- "memory": no file goes to storage. Each rank's node keeps the files and pushes a replica to its
  peer; once every rank's files are on two nodes in different failure domains
  (`memtier.memory_committed`), the manifest is written (a few KB: it is what restores and a
  relaunched driver read) and the ranks hear `Committed`. A checkpoint that cannot get there is
  refused, saying why.

Once committed, every node holding a copy is told (`TierCommit`), so its budget never evicts the
run's newest committed copy. Where the copies are is recorded in the run's history
(`RunBook.note_memory`) as the answers come in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from outlast.controller import effects as fx
from outlast.protocol import messages as m
from outlast.storage.memtier import PeerCandidate, choose_peer, memory_committed

if TYPE_CHECKING:
    from outlast.controller.checkpoints import Committing
    from outlast.controller.commit import PendingCheckpoint
    from outlast.controller.core import ControllerCore
    from outlast.storage.records import CheckpointRecord

log = logging.getLogger("outlast.controller")

STORAGE, MEMORY = "storage", "memory"
LOCAL_COPY_TIMEOUT_S = 120.0  # a copy at memory speed; a commit waits on it in "storage" mode
REPLICA_TIMEOUT_S = 600.0
FREE_TIMEOUT_S = 10.0
FREE_WAIT_S = 5.0  # a run's close waits this long at most for its nodes to free its copies

OnTier = Callable[["ControllerCore", fx.TierAnswered], None]


@dataclass
class Holding:
    """One checkpoint's copies in the nodes' memory, while they are being made and after."""

    checkpoint_dir: str
    index: int  # the report it came with
    attempt: int
    seq: int
    node_of: dict[int, str]  # rank -> its node
    files: dict[int, list[m.FileEntry]]
    asked: set[int] = field(default_factory=set)  # ranks whose node was asked to keep their files
    waiting: set[int] = field(default_factory=set)  # ranks whose first answer has not come
    holders: dict[int, set[str]] = field(default_factory=dict)  # rank -> nodes that keep its files
    refused: dict[int, str] = field(default_factory=dict)  # rank -> why it has no copy (or no replica)
    committed: bool = False
    tell: "Committing | None" = None  # a commit whose ranks hear it once `waiting` is empty
    on_all: Callable[["ControllerCore", "Holding"], None] | None = None  # "memory": once every rank answered
    told_commit: set[str] = field(default_factory=set)  # nodes sent a TierCommit


def ask_tier(c: "ControllerCore", node_id: str, address: str, msg: m.Msg, on_answer: OnTier | None,
             timeout_s: float = REPLICA_TIMEOUT_S) -> int:
    c._next_id += 1
    c.out.append(fx.TierAsk(c._next_id, node_id, address, msg, timeout_s))
    c.tier_asks[c._next_id] = on_answer
    return c._next_id


def on_tier_answered(c: "ControllerCore", event: fx.TierAnswered) -> None:
    on_answer = c.tier_asks.pop(event.id, None)
    if on_answer is not None:
        on_answer(c, event)


def run_key(c: "ControllerCore") -> str:
    """The run as the tiers and restores name it: the same across its drivers and attempts."""
    store = c.plan.book.store
    return store.storage.uri(store.run_dir)


def tier_of(c: "ControllerCore", node_id: str) -> str:
    """The node's tier, while this driver can reach the node: none of a node that is gone (dead in the table, its
    agent gone from this machine, or lost by this driver), whose copies and answers are gone with it."""
    node = c.nodes.nodes.get(node_id)
    return node.tier_address if node is not None and c.nodes.reachable(node_id) else ""


def peer_for(c: "ControllerCore", node_id: str) -> tuple[str, str, str]:
    """(peer node, its tier's address, why) for the replica of `node_id`'s copies."""
    candidates = [PeerCandidate(n.node_id, n.failure_domain, alive=c.nodes.reachable(n.node_id),
                                draining=n.state == "draining")
                  for n in c.nodes.nodes.values() if n.tier_address or n.node_id == node_id]
    choice = choose_peer(node_id, candidates)
    if choice.node_id is None:
        return "", "", choice.reason
    return choice.node_id, c.nodes.nodes[choice.node_id].tier_address, choice.reason


def _hold(c: "ControllerCore", h: Holding, rank: int, source_dir: str, peer_address: str) -> m.TierHold:
    # A draining node's copy is the rank's own files, linked: a drain's deadline is no time to copy them
    # on a node that is going away, and its replica is what the restart reads.
    node = c.nodes.nodes.get(h.node_of.get(rank, ""))
    return m.TierHold(run=run_key(c), checkpoint_dir=h.checkpoint_dir, rank=rank, seq=h.seq, files=h.files[rank],
                      source_dir=source_dir, peer_address=peer_address,
                      link=bool(source_dir) and node is not None and node.state == "draining")


def local_dirs_of(c: "ControllerCore", pending: "PendingCheckpoint", attempt: int) -> dict[int, str]:
    """The ranks' own directories of this checkpoint, as their reports named them (taken: used once)."""
    out = {}
    for rank in pending.files:
        where = c.local_dirs.pop((attempt, pending.index, rank), "")
        if where:
            out[rank] = where
    for key in [k for k in c.local_dirs if k[0] != attempt or k[1] <= pending.index]:
        del c.local_dirs[key]
    return out


# ---- "storage": a copy in memory beside the durable commit ----------------------------------


def keep_beside(c: "ControllerCore", pending: "PendingCheckpoint", attempt: int, seq: int,
                local_dirs: dict[int, str]) -> None:
    """Each rank's node copies its files in now; the replicas follow once each copy is kept."""
    a = c.attempt
    if a is None or a.number != attempt:
        return
    h = Holding(pending.checkpoint_dir, pending.index, attempt, seq, dict(a.placement), dict(pending.files))
    for rank, where in sorted(local_dirs.items()):
        node = a.placement.get(rank, "")
        address = tier_of(c, node)
        if not address or not h.files.get(rank):
            continue
        h.waiting.add(rank)
        h.asked.add(rank)
        ask_tier(c, node, address, _hold(c, h, rank, where, ""),
                 lambda c, e, rank=rank, h=h: _local_answered(c, h, rank, e), LOCAL_COPY_TIMEOUT_S)
    if h.waiting:
        c.holds[h.checkpoint_dir] = h


def hold_commit_back(c: "ControllerCore", checkpoint_dir: str, committing: "Committing") -> bool:
    """Phase two of a "storage" commit: True when its ranks hear it later, once their nodes' copies answered."""
    h = c.holds.get(checkpoint_dir)
    if h is None:
        return False
    mark_committed(c, h)
    if not h.waiting:
        return False
    h.tell = committing
    return True


def _local_answered(c: "ControllerCore", h: Holding, rank: int, e: fx.TierAnswered) -> None:
    h.waiting.discard(rank)
    node = h.node_of[rank]
    stored = e.reply if isinstance(e.reply, m.TierStored) else None
    if stored is not None and stored.ok:
        h.holders.setdefault(rank, set()).add(node)
        peer, address, why = peer_for(c, node)
        if address and tier_of(c, node):
            ask_tier(c, node, tier_of(c, node), _hold(c, h, rank, "", address),
                     lambda c, e, rank=rank, h=h: _replica_answered(c, h, rank, e))
        else:
            # A run on one node, or on nodes of one failure domain: nothing to replicate to, as expected.
            h.refused[rank] = f"no replica: {why}"
            if why not in c.tier_said:
                c.tier_said.add(why)
                log.info("checkpoints are kept in memory on their own node only: %s", why)
    else:
        _refused(c, h, rank, stored.reason if stored is not None else e.error or "no answer")
    _record(c, h)
    if not h.waiting and h.tell is not None:
        from outlast.controller import checkpoints, on_workers

        committing, h.tell = h.tell, None
        a = c.attempt
        if a is not None and a.number == committing.attempt:
            checkpoints.tell_ranks(c, committing)
            on_workers.finish_if_settled(c, a)


def _replica_answered(c: "ControllerCore", h: Holding, rank: int, e: fx.TierAnswered) -> None:
    stored = e.reply if isinstance(e.reply, m.TierStored) else None
    if stored is not None and stored.replica_node:
        measured(c, h.node_of[rank], stored)
        h.holders.setdefault(rank, set()).add(stored.replica_node)
        log.info("checkpoint %s rank %d: a replica is in memory on %s (%.1f s)", h.checkpoint_dir, rank,
                 stored.replica_node, stored.replica_seconds)
    else:
        _refused(c, h, rank, (stored.replica_reason or stored.reason) if stored is not None else e.error)
    _record(c, h)


def measured(c: "ControllerCore", node_id: str, stored: m.TierStored) -> None:
    """The node's rate to its peer, as its last replica went: what a notice's copy through a peer is weighed at."""
    if stored.replica_seconds > 0 and stored.nbytes:
        c.peer_bps[node_id] = stored.nbytes / stored.replica_seconds


def _refused(c: "ControllerCore", h: Holding, rank: int, why: str) -> None:
    """A copy the tier did not keep: storage has it (this is "storage" mode), so a warning, once a reason."""
    h.refused[rank] = why
    if why not in c.tier_said:
        c.tier_said.add(why)
        log.warning("checkpoint %s rank %d is not held in memory on two nodes (storage keeps it): %s",
                    h.checkpoint_dir, rank, why)


# ---- "memory": committed once two nodes hold every rank's files -----------------------------


def commit_in_memory(c: "ControllerCore", pending: "PendingCheckpoint", attempt: int, seq: int,
                     local_dirs: dict[int, str], then: Callable[["ControllerCore", "Holding"], None]) -> str | None:
    """Ask every rank's node to keep its files and replicate them; `then(holding)` once all answered.
    Returns why it cannot begin (the commit is refused), else None."""
    a = c.attempt
    assert a is not None
    h = Holding(pending.checkpoint_dir, pending.index, attempt, seq, dict(a.placement), dict(pending.files),
                on_all=then)
    asks = []
    for rank in sorted(r for r, files in pending.files.items() if files):
        node = a.placement.get(rank, "")
        address = tier_of(c, node)
        if not address:
            return (f"rank {rank}'s node {node} keeps no checkpoint memory (start it with `outlast start "
                    "--checkpoint-memory SIZE`), and CheckpointConfig(checkpoint_storage='memory') keeps checkpoints "
                    "in memory only")
        if rank not in local_dirs:
            return f"rank {rank} did not say where its files are on its node"
        peer, peer_address, why = peer_for(c, node)
        if not peer_address:
            return (f"rank {rank}'s files have no second node to go to ({why}); a checkpoint kept in memory only "
                    "needs nodes in two failure domains, or CheckpointConfig(checkpoint_storage='storage')")
        asks.append((rank, node, address, _hold(c, h, rank, local_dirs[rank], peer_address)))
    c.holds[h.checkpoint_dir] = h
    for rank, node, address, hold in asks:
        h.waiting.add(rank)
        h.asked.add(rank)
        ask_tier(c, node, address, hold, lambda c, e, rank=rank, h=h: _memory_answered(c, h, rank, e))
    if not h.waiting:
        then(c, h)
    return None


def stuck_without_head(c: "ControllerCore") -> str | None:
    """Why no checkpoint of this "memory" run can be committed again, or None: some node of the attempt has no
    peer in another failure domain, and with the head gone no node can join to be one."""
    a, gone = c.attempt, c.nodes.head_lost(c.now)
    if a is None or gone is None:
        return None
    for node in sorted(set(a.placement.values())):
        peer, address, why = peer_for(c, node)
        if not address:
            return (f"{gone}. A checkpoint kept in memory only (CheckpointConfig(checkpoint_storage='memory')) needs "
                    f"a second node in another failure domain, and there is none for {node} ({why})")
    return None


def _memory_answered(c: "ControllerCore", h: Holding, rank: int, e: fx.TierAnswered) -> None:
    h.waiting.discard(rank)
    stored = e.reply if isinstance(e.reply, m.TierStored) else None
    if stored is not None and stored.ok:
        h.holders.setdefault(rank, set()).add(stored.node_id)
        if stored.replica_node:
            measured(c, stored.node_id, stored)
            h.holders[rank].add(stored.replica_node)
            log.info("checkpoint %s rank %d: %.1f MB in memory on %s and %s in %.1f s (the replica %.1f s)",
                     h.checkpoint_dir, rank, stored.nbytes / 1e6, stored.node_id, stored.replica_node,
                     stored.seconds, stored.replica_seconds)
        else:
            h.refused[rank] = stored.replica_reason
    else:
        h.refused[rank] = stored.reason if stored is not None else e.error or "no answer"
    if not h.waiting and h.on_all is not None:
        then, h.on_all = h.on_all, None
        then(c, h)


def in_memory(c: "ControllerCore", h: Holding) -> tuple[bool, str]:
    domain = {n.node_id: n.failure_domain or f"node:{n.node_id}" for n in c.nodes.nodes.values()}
    ranks = [r for r, files in h.files.items() if files]
    ok, why = memory_committed(ranks, h.node_of, h.holders, domain)
    if not ok and h.refused:
        why += "; " + "; ".join(f"rank {r}: {w}" for r, w in sorted(h.refused.items()))
    return ok, why


def record_of(c: "ControllerCore", checkpoint_dir: str) -> "CheckpointRecord | None":
    """The run's record of a checkpoint, as it is now (its holders change as copies are pulled), or None."""
    return next((r for r in c.book.state.checkpoints if r.checkpoint_dir == checkpoint_dir), None)


def pending_in_memory(c: "ControllerCore") -> set[str]:
    """Checkpoints of a "memory" run whose copies are being made: their commit has begun."""
    return {d for d, h in c.holds.items() if h.on_all is not None}


# ---- both ----------------------------------------------------------------------------------


def mark_committed(c: "ControllerCore", h: Holding) -> None:
    h.committed = True
    _record(c, h)


def _record(c: "ControllerCore", h: Holding) -> None:
    """The history says where the copies are; every holder learns the checkpoint is committed."""
    if not h.committed:
        return
    nodes = sorted(set().union(*h.holders.values())) if h.holders else []
    ok, _ = in_memory(c, h)
    c.book.note_memory(h.checkpoint_dir, {r: sorted(ns) for r, ns in h.holders.items()}, c.wall() if ok else None)
    note_files(c, h)
    run = run_key(c) if nodes else ""
    for node in nodes:
        address = tier_of(c, node)
        if node not in h.told_commit and address:
            h.told_commit.add(node)
            ask_tier(c, node, address, m.TierCommit(run=run, checkpoint_dir=h.checkpoint_dir), None, 30.0)
    if not h.waiting and all(len(h.holders.get(r, ())) >= 2 or r in h.refused for r in h.asked):
        c.holds.pop(h.checkpoint_dir, None)  # every answer is in


def note_files(c: "ControllerCore", h: Holding) -> None:
    """Each rank's own files, by name, while the history names the checkpoint: what a checkpoint lost with its
    nodes says was lost (kept by this driver only; the manifest lists every file, not whose it is)."""
    c.rank_files[h.checkpoint_dir] = {r: sorted(f.path for f in files) for r, files in h.files.items() if files}
    named = {r.checkpoint_dir for r in c.book.state.checkpoints} | set(c.holds)
    for name in [d for d in c.rank_files if d not in named]:
        del c.rank_files[name]


# ---- the run's end -------------------------------------------------------------------------------


def free_at_end(c: "ControllerCore") -> None:
    """A "storage" run that ends with every checkpoint durable frees its copies in memory on every node that
    holds one: else each node's copy of its newest committed checkpoint, which the budget never evicts, would
    take that node's memory for good. The run's close waits for the answers `FREE_WAIT_S` at most
    (`ControllerCore.freeing`). A "memory" run's copies are its only ones: they stay."""
    records = c.book.state.checkpoints
    if c.plan.checkpoint_storage != STORAGE or not records or not all(r.durable for r in records) or c.durable:
        return
    nodes = {n for r in records for n in r.memory} | {n for h in c.holds.values() for ns in h.holders.values()
                                                       for n in ns}
    run = run_key(c)
    for node in sorted(nodes):
        address = tier_of(c, node)
        if address:
            c.freeing.add(ask_tier(c, node, address, m.TierFree(run=run), _freed, FREE_TIMEOUT_S))
    c.free_by = c.now + FREE_WAIT_S


def _freed(c: "ControllerCore", e: fx.TierAnswered) -> None:
    c.freeing.discard(e.id)
    if not isinstance(e.reply, m.TierAck):
        log.info("copies in memory of this run may stay on a node (%s); its budget evicts them as it needs",
                 e.error or type(e.reply).__name__)
