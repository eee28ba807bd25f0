"""A drain's just-in-time checkpoint through a peer: committed in memory first, made durable afterwards.

A "storage" run's notice tells the ranks (`PreemptionNotice.through_peer`) to report the checkpoint
they save for it without uploading it (`Report.in_memory`), when every node of the attempt keeps a
memory tier and has a peer in another failure domain that is not draining (`decide`). That checkpoint is then
committed as a memory-only one is (`Holds.commit_in_memory`: each rank's node keeps its files
and pushes a replica to a peer that is not draining; the manifest, a few KB, says `durable: false`), so
the ranks hear `Committed`, and the run restarts from it, once it is on two nodes: a deadline never
waits on storage's bandwidth. The controller's upload estimate weighs the copy to the peer, at the
rate the node's last replica was measured at (`Commits.peer_rate`).

Then each rank's files are uploaded to storage by a node that holds them and is not draining
(`TierUpload`, carried out on the agent's upload thread, off its poll loop), after the drained node
is gone if need be; once every rank's are there, the manifest is written again with `durable: true`
and the history says so. Each request is an effect answered by an event: nothing here waits. The
run does not finish while such an upload is in flight (`in_flight`), so that `fit()` returns with
every checkpoint it committed at the level the run chose.
"""

from __future__ import annotations

import logging

import msgspec

from outlast.controller import effects as fx
from outlast.controller.commits.events import DurableDone, NoteDurable, NoteOnce, Out
from outlast.controller.commits.pending import Asks, Durable, DurableWrite, Holding, Upload
from outlast.controller.commits.view import STORAGE, View
from outlast.protocol import messages as m
from outlast.storage.records import Manifest

log = logging.getLogger("outlast.controller")

UPLOAD_TIMEOUT_S = 3600.0  # a whole checkpoint at storage's speed


def decide(view: View) -> tuple[bool, str]:
    """Whether a notice's checkpoint goes to a peer's memory first, and why (or why not)."""
    if view.level != STORAGE or view.attempt is None:
        return False, "the run keeps its checkpoints in memory only"
    bare = sorted({n for n in view.placement.values() if not view.tier_of(n)})
    if bare:
        return False, f"node{'s' * (len(bare) > 1)} {', '.join(bare)} keep{'s' * (len(bare) == 1)} no checkpoint memory"
    for node in sorted(set(view.placement.values())):  # every rank's files need a second node
        peer, _, why = view.peer_for(node)
        if not peer:
            return False, why
    return True, "every node keeps checkpoint memory and has a peer in another failure domain that is not draining"


class PeerUploads:
    def __init__(self, asks: Asks) -> None:
        self._asks = asks
        self.through_peer: set[tuple[int, int]] = set()  # (attempt, report) of notices' checkpoints through a peer
        self.durable: dict[str, Durable] = {}  # committed through a peer, being uploaded

    def is_through_peer(self, attempt: int, index: int) -> bool:
        return (attempt, index) in self.through_peer

    def upload_after(self, view: View, h: Holding) -> None:
        """The checkpoint is held on two nodes: upload it once its manifest is written (`after_commit`)."""
        draining = view.draining()
        holders = {rank: sorted(nodes, key=lambda n: (n in draining, n != h.node_of.get(rank), n))
                   for rank, nodes in h.holders.items() if h.files.get(rank)}
        self.durable[h.checkpoint_dir] = Durable(holders)

    def in_flight(self) -> set[str]:
        return set(self.durable)

    def after_commit(self, view: View, manifest: Manifest, out: list[Out]) -> None:
        d = self.durable.get(manifest.checkpoint_dir)
        if d is None or d.manifest is not None:
            return
        d.manifest = manifest
        d.left = set(d.holders)
        if not d.left:
            self.durable.pop(manifest.checkpoint_dir)
            return
        for rank in sorted(d.holders):
            self._ask(view, d, rank, out)

    def on_timers(self, view: View, out: list[Out]) -> None:
        """An upload whose node is lost never answers: it goes on from the rank's next holder."""
        for d in list(self.durable.values()):
            for rank, (node, ask_id) in sorted(d.asked.items()):
                facts = view.nodes.get(node)
                if facts is None or not facts.reachable:
                    self._asks.tiers.pop(ask_id, None)
                    del d.asked[rank]
                    d.failed[rank] = f"{node}, which was uploading its files, is gone"
                    log.warning("checkpoint %s rank %d: %s", d.manifest.checkpoint_dir if d.manifest else "?", rank,
                                d.failed[rank])
                    self._ask(view, d, rank, out)

    def _ask(self, view: View, d: Durable, rank: int, out: list[Out]) -> None:
        assert d.manifest is not None
        name = d.manifest.checkpoint_dir
        nodes = [n for n in d.holders[rank] if view.tier_of(n)]
        if not nodes:
            d.left.discard(rank)
            d.failed[rank] = d.failed.get(rank) or "no node that holds its files is left"
            self._settle(d, out)
            return
        node, d.holders[rank] = nodes[0], nodes[1:]
        # Ranks share the directory: where two wrote one file, the lowest rank's copy is the one the manifest
        # names, so it alone replaces.
        up = m.TierUpload(run=view.run_key, checkpoint_dir=name, rank=rank, replace=rank == min(d.holders))
        d.asked[rank] = (node, self._asks.tier(out, node, view.tier_of(node), up, Upload(d, rank, name),
                                               UPLOAD_TIMEOUT_S))

    def on_upload(self, ask: Upload, e: fx.TierAnswered, view: View, out: list[Out]) -> None:
        d, rank, name = ask.durable, ask.rank, ask.checkpoint_dir
        d.asked.pop(rank, None)
        stored = e.reply if isinstance(e.reply, m.TierStored) else None
        if stored is None or not stored.ok:
            why = stored.reason if stored is not None else e.error
            log.warning("checkpoint %s rank %d: %s", name, rank, why)
            d.failed[rank] = why
            self._ask(view, d, rank, out)
            return
        d.failed.pop(rank, None)
        d.seconds = max(d.seconds, stored.seconds)
        log.info("checkpoint %s rank %d: uploaded from the memory of %s (%.1f MB in %.1f s)", name, rank,
                 stored.node_id, stored.nbytes / 1e6, stored.seconds)
        d.left.discard(rank)
        self._settle(d, out)

    def _settle(self, d: Durable, out: list[Out]) -> None:
        if d.left or d.manifest is None:
            return
        name = d.manifest.checkpoint_dir
        if d.failed:
            self.durable.pop(name, None)
            text = (f"checkpoint {name} stays committed in memory only: "
                    + "; ".join(f"rank {r}: {why}" for r, why in sorted(d.failed.items())))
            log.warning("%s", text)
            out += [NoteOnce(text), DurableDone(name)]
            return
        manifest = msgspec.structs.replace(d.manifest, durable=True)
        self._asks.store(out, lambda i: fx.WriteManifest(i, manifest), DurableWrite(d))

    def on_durable(self, ask: DurableWrite, done: fx.ManifestWritten, view: View, out: list[Out]) -> None:
        d = ask.durable
        assert d.manifest is not None
        name = d.manifest.checkpoint_dir
        self.durable.pop(name, None)
        text = (f"checkpoint {name}, committed in memory for the drain, is durable: every rank's files were uploaded "
                f"from the memory of the nodes that hold them ({d.seconds:.1f} s)")
        log.info("%s", text)
        out += [NoteDurable(name), NoteOnce(text), DurableDone(name)]

    def on_durable_failed(self, ask: DurableWrite) -> None:
        """Its manifest could not be written again: the checkpoint stays committed in memory only (the core gives
        up the run, as for any write storage failed)."""
        if ask.durable.manifest is not None:
            self.durable.pop(ask.durable.manifest.checkpoint_dir, None)
