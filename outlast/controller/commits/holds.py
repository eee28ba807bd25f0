"""The commit machine's copies in the nodes' memory: which node keeps each rank's copy, where its replica
goes, and when a checkpoint is committed in memory.

Every request to a node's tier is an effect (`effects.TierAsk`), its answer an event
(`TierAnswered`); nothing waits on a copy. Two ways to commit, the run's choice
(`CheckpointConfig(checkpoint_storage=...)`):

- "storage" (the default): the manifest is written as always, and each rank's node copies that rank's
  files into its memory. Where storage is a file system the node sees, the copy is taken from the
  checkpoint's directory there, which stays: the ranks hear `Committed` once the manifest is written,
  and the node is asked for the copy after that, which goes on beside their next steps. Else it is
  taken from the rank's own directory, beside the manifest's write, and the ranks hear `Committed`
  once the manifest is written and every such copy has answered (kept or refused), so the worker's
  own directory is no longer needed. Each copy kept then
  goes to a peer in another failure domain, off the commit.
- "memory": no file goes to storage. Each rank's node keeps the files and pushes a replica to its
  peer; once every rank's files are on two nodes in different failure domains
  (`memtier.memory_committed`), the manifest is written (a few KB: it is what restores and a
  relaunched driver read) and the ranks hear `Committed`. A checkpoint that cannot get there is
  refused, saying why.

Once committed, every node holding a copy is told (`TierCommit`), so its budget never evicts the
run's newest committed copy. Where the copies are goes to the run's history (`NoteMemory`) as the
answers come in.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from outlast.controller import effects as fx
from outlast.controller.commit import PendingCheckpoint
from outlast.controller.commits.events import CommitDone, NoteFiles, NoteMemory, Out
from outlast.controller.commits.pending import (
    Asks, Committing, Free, Holding, LocalCopy, MemoryCommit, MemoryCopy, Replica, Told,
)
from outlast.controller.commits.view import View
from outlast.protocol import messages as m
from outlast.storage.memtier import memory_committed

log = logging.getLogger("outlast.controller")

LOCAL_COPY_TIMEOUT_S = 120.0  # a copy at memory speed; a commit waits on it in "storage" mode
REPLICA_TIMEOUT_S = 600.0
FREE_TIMEOUT_S = 10.0
FREE_WAIT_S = 5.0  # a run's close waits this long at most for its nodes to free its copies


class Holds:
    def __init__(self, asks: Asks) -> None:
        self._asks = asks
        self.holds: dict[str, Holding] = {}  # checkpoints whose copies in memory are being made
        self.said: set[str] = set()  # why a copy was not kept in memory, each said once
        self.peer_bps: dict[str, float] = {}  # node -> its last replica's rate to its peer
        self.freeing: set[int] = set()  # the run's end: nodes asked to free its copies, not yet answered
        self.free_by = 0.0  # when the close stops waiting for them

    def _hold(self, view: View, h: Holding, rank: int, source_dir: str, peer_address: str) -> m.TierHold:
        # A draining node's copy is the rank's own files, linked: a drain's deadline is no time to copy them
        # on a node that is going away, and its replica is what the restart reads.
        node = view.nodes.get(h.node_of.get(rank, ""))
        return m.TierHold(run=view.run_key, checkpoint_dir=h.checkpoint_dir, rank=rank, seq=h.seq,
                          files=h.files[rank], source_dir=source_dir, peer_address=peer_address,
                          link=bool(source_dir) and node is not None and node.draining)

    # ---- "storage": a copy in memory beside the durable commit ----------------------------------

    def keep_beside(self, view: View, pending: PendingCheckpoint, attempt: int, seq: int, local_dirs: dict[int, str],
                    out: list[Out], stored: Collection[int] = (), stored_files: Sequence[m.FileEntry] = ()) -> None:
        """Each rank's node copies its files in; the replicas follow once each copy is kept.

        The commit waits for a copy from a rank's own directory, which the rank may delete once `report()` returns:
        that copy is asked for now, beside the manifest. Not for one from a rank's directory in storage (`stored`),
        which stays: that copy is asked for once the manifest is written (`copy_from_storage`), so that its
        work on the node never competes with the commit the rank waits for, and goes on beside the rank's next
        steps. Such a copy's files are what storage holds (`stored_files`, the manifest's): of a file several
        ranks wrote, storage kept one rank's."""
        if view.attempt != attempt:
            return
        h = Holding(pending.checkpoint_dir, pending.index, attempt, seq, dict(view.placement), dict(pending.files))
        in_storage = {f.path: f for f in stored_files}
        for rank, where in sorted(local_dirs.items()):
            node = view.placement.get(rank, "")
            address = view.tier_of(node)
            if not address or not h.files.get(rank):
                continue
            if rank in stored:
                h.files[rank] = [in_storage.get(f.path, f) for f in h.files[rank]]
                h.after_commit[rank] = where
                continue
            h.waiting.add(rank)
            self._ask_local(view, h, rank, where, out)
        if h.asked or h.after_commit:
            self.holds[h.checkpoint_dir] = h

    def _ask_local(self, view: View, h: Holding, rank: int, source_dir: str, out: list[Out]) -> None:
        node = h.node_of.get(rank, "")
        h.asked.add(rank)
        self._asks.tier(out, node, view.tier_of(node), self._hold(view, h, rank, source_dir, ""), LocalCopy(h, rank),
                        LOCAL_COPY_TIMEOUT_S)

    def copy_from_storage(self, view: View, checkpoint_dir: str, out: list[Out]) -> None:
        """A "storage" commit is written and its ranks told: the nodes copy the files of the ranks whose copy comes
        from the checkpoint's directory in storage."""
        h = self.holds.get(checkpoint_dir)
        if h is None or view.attempt != h.attempt:
            return
        later, h.after_commit = h.after_commit, {}
        for rank, where in sorted(later.items()):
            if view.tier_of(h.node_of.get(rank, "")):
                self._ask_local(view, h, rank, where, out)

    def hold_commit_back(self, view: View, checkpoint_dir: str, committing: Committing, out: list[Out]) -> bool:
        """Phase two of a "storage" commit: True when its ranks hear it later, once their nodes' copies answered."""
        h = self.holds.get(checkpoint_dir)
        if h is None:
            return False
        h.committed = True
        self._record(view, h, out)
        if not h.waiting:
            return False
        h.tell = committing
        return True

    def on_local(self, ask: LocalCopy, e: fx.TierAnswered, view: View, out: list[Out]) -> None:
        h, rank = ask.holding, ask.rank
        h.waiting.discard(rank)
        node = h.node_of[rank]
        stored = e.reply if isinstance(e.reply, m.TierStored) else None
        if stored is not None and stored.ok:
            h.holders.setdefault(rank, set()).add(node)
            peer, address, why = view.peer_for(node)
            if address and view.tier_of(node):
                self._asks.tier(out, node, view.tier_of(node), self._hold(view, h, rank, "", address), Replica(h, rank),
                                REPLICA_TIMEOUT_S)
            else:
                # A run on one node, or on nodes of one failure domain: nothing to replicate to, as expected.
                h.refused[rank] = f"no replica: {why}"
                if why not in self.said:
                    self.said.add(why)
                    log.info("checkpoints are kept in memory on their own node only: %s", why)
        else:
            self._refused(h, rank, stored.reason if stored is not None else e.error or "no answer")
        self._record(view, h, out)
        if not h.waiting and h.tell is not None:
            committing, h.tell = h.tell, None
            out.append(CommitDone(committing.pending, committing.attempt))

    def on_replica(self, ask: Replica, e: fx.TierAnswered, view: View, out: list[Out]) -> None:
        h, rank = ask.holding, ask.rank
        stored = e.reply if isinstance(e.reply, m.TierStored) else None
        if stored is not None and stored.replica_node:
            self._measured(h.node_of[rank], stored)
            h.holders.setdefault(rank, set()).add(stored.replica_node)
            log.info("checkpoint %s rank %d: a replica is in memory on %s (%.1f s)", h.checkpoint_dir, rank,
                     stored.replica_node, stored.replica_seconds)
        else:
            self._refused(h, rank, (stored.replica_reason or stored.reason) if stored is not None else e.error)
        self._record(view, h, out)

    def _measured(self, node_id: str, stored: m.TierStored) -> None:
        """The node's rate to its peer, as its last replica went: what a notice's copy through a peer is weighed at."""
        if stored.replica_seconds > 0 and stored.nbytes:
            self.peer_bps[node_id] = stored.nbytes / stored.replica_seconds

    def _refused(self, h: Holding, rank: int, why: str) -> None:
        """A copy the tier did not keep: storage has it (this is "storage" mode), so a warning, once a reason."""
        h.refused[rank] = why
        if why not in self.said:
            self.said.add(why)
            log.warning("checkpoint %s rank %d is not held in memory on two nodes (storage keeps it): %s",
                        h.checkpoint_dir, rank, why)

    # ---- "memory": committed once two nodes hold every rank's files -----------------------------

    def commit_in_memory(self, view: View, commit: MemoryCommit, local_dirs: dict[int, str],
                         out: list[Out]) -> Holding | str:
        """Ask every rank's node to keep its files and replicate them; the commit goes on once all answered
        (`on_memory`). Returns the holding, or why it cannot begin (the commit is refused)."""
        pending = commit.pending
        h = Holding(pending.checkpoint_dir, pending.index, commit.attempt, commit.seq, dict(view.placement),
                    dict(pending.files), on_all=commit)
        asks = []
        for rank in sorted(r for r, files in pending.files.items() if files):
            node = view.placement.get(rank, "")
            address = view.tier_of(node)
            if not address:
                return (f"rank {rank}'s node {node} keeps no checkpoint memory (start it with `outlast start "
                        "--checkpoint-memory SIZE`), and CheckpointConfig(checkpoint_storage='memory') keeps "
                        "checkpoints in memory only")
            if rank not in local_dirs:
                return f"rank {rank} did not say where its files are on its node"
            peer, peer_address, why = view.peer_for(node)
            if not peer_address:
                return (f"rank {rank}'s files have no second node to go to ({why}); a checkpoint kept in memory "
                        "only needs nodes in two failure domains, or CheckpointConfig(checkpoint_storage='storage')")
            asks.append((rank, node, address, self._hold(view, h, rank, local_dirs[rank], peer_address)))
        self.holds[h.checkpoint_dir] = h
        for rank, node, address, hold in asks:
            h.waiting.add(rank)
            h.asked.add(rank)
            self._asks.tier(out, node, address, hold, MemoryCopy(h, rank), REPLICA_TIMEOUT_S)
        return h

    def on_memory(self, ask: MemoryCopy, e: fx.TierAnswered) -> MemoryCommit | None:
        """A rank's copy and replica answered; the commit to go on with once every rank's have."""
        h, rank = ask.holding, ask.rank
        h.waiting.discard(rank)
        stored = e.reply if isinstance(e.reply, m.TierStored) else None
        if stored is not None and stored.ok:
            h.holders.setdefault(rank, set()).add(stored.node_id)
            if stored.replica_node:
                self._measured(stored.node_id, stored)
                h.holders[rank].add(stored.replica_node)
                log.info("checkpoint %s rank %d: %.1f MB in memory on %s and %s in %.1f s (the replica %.1f s)",
                         h.checkpoint_dir, rank, stored.nbytes / 1e6, stored.node_id, stored.replica_node,
                         stored.seconds, stored.replica_seconds)
            else:
                h.refused[rank] = stored.replica_reason
        else:
            h.refused[rank] = stored.reason if stored is not None else e.error or "no answer"
        if not h.waiting and h.on_all is not None:
            commit, h.on_all = h.on_all, None
            return commit
        return None

    def stuck_without_head(self, view: View) -> str | None:
        """Why no checkpoint of this "memory" run can be committed again, or None: some node of the attempt has
        no peer in another failure domain, and with the head gone no node can join to be one."""
        if view.attempt is None or view.head_lost is None:
            return None
        for node in sorted(set(view.placement.values())):
            peer, address, why = view.peer_for(node)
            if not address:
                return (f"{view.head_lost}. A checkpoint kept in memory only (CheckpointConfig(checkpoint_storage="
                        f"'memory')) needs a second node in another failure domain, and there is none for {node} "
                        f"({why})")
        return None

    def in_memory(self, view: View, h: Holding) -> tuple[bool, str]:
        ranks = [r for r, files in h.files.items() if files]
        ok, why = memory_committed(ranks, h.node_of, h.holders, view.domains())
        if not ok and h.refused:
            why += "; " + "; ".join(f"rank {r}: {w}" for r, w in sorted(h.refused.items()))
        return ok, why

    def pending_in_memory(self) -> set[str]:
        """Checkpoints of a "memory" run whose copies are being made: their commit has begun."""
        return {d for d, h in self.holds.items() if h.on_all is not None}

    # ---- both ----------------------------------------------------------------------------------

    def _record(self, view: View, h: Holding, out: list[Out]) -> None:
        """The history says where the copies are; every holder learns the checkpoint is committed."""
        if not h.committed:
            return
        nodes = sorted(set().union(*h.holders.values())) if h.holders else []
        ok, _ = self.in_memory(view, h)
        out.append(NoteMemory(h.checkpoint_dir, {r: sorted(ns) for r, ns in h.holders.items()},
                              view.wall if ok else None))
        out.append(NoteFiles(h.checkpoint_dir, {r: sorted(f.path for f in files) for r, files in h.files.items()
                                                if files}, frozenset(self.holds)))
        run = view.run_key if nodes else ""
        for node in nodes:
            address = view.tier_of(node)
            if node not in h.told_commit and address:
                h.told_commit.add(node)
                self._asks.tier(out, node, address, m.TierCommit(run=run, checkpoint_dir=h.checkpoint_dir), Told(),
                                30.0)
        if not h.waiting and not h.after_commit and all(len(h.holders.get(r, ())) >= 2 or r in h.refused
                                                        for r in h.asked):
            self.holds.pop(h.checkpoint_dir, None)  # every answer is in

    # ---- the run's end ---------------------------------------------------------------------------

    def free(self, view: View, nodes: set[str], now: float, out: list[Out]) -> None:
        """Every node that holds a copy of the run's frees it; the run's close waits for the answers
        `FREE_WAIT_S` at most."""
        for node in sorted(nodes):
            address = view.tier_of(node)
            if address:
                self.freeing.add(self._asks.tier(out, node, address, m.TierFree(run=view.run_key), Free(),
                                                 FREE_TIMEOUT_S))
        self.free_by = now + FREE_WAIT_S

    def on_freed(self, ask: Free, e: fx.TierAnswered, view: View, out: list[Out]) -> None:
        self.freeing.discard(e.id)
        if not isinstance(e.reply, m.TierAck):
            log.info("copies in memory of this run may stay on a node (%s); its budget evicts them as it needs",
                     e.error or type(e.reply).__name__)
