"""A drain's just-in-time checkpoint through a peer: committed in memory first, made durable afterwards.

A "storage" run's notice tells the ranks (`PreemptionNotice.through_peer`) to report the checkpoint
they save for it without uploading it (`Report.in_memory`), when every node of the attempt keeps a
memory tier and has a peer in another failure domain that is not draining (`decide`). That checkpoint is then
committed as a memory-only one is (`memory_holds.commit_in_memory`: each rank's node keeps its files
and pushes a replica to a peer that is not draining; the manifest, a few KB, says `durable: false`), so
the ranks hear `Committed`, and the run restarts from it, once it is on two nodes: a deadline never
waits on storage's bandwidth. The controller's upload estimate weighs the copy to the peer, at the
rate the node's last replica was measured at (`peer_rate`).

Then each rank's files are uploaded to storage by a node that holds them and is not draining
(`TierUpload`, carried out on the agent's upload thread, off its poll loop), after the drained node
is gone if need be; once every rank's are there, the manifest is written again with `durable: true`
and the history says so. Each request is an effect answered by an event: nothing here waits. The
run does not finish while such an upload is in flight (`in_flight`), so that `fit()` returns with
every checkpoint it committed at the level the run chose.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from outlast.controller import effects as fx
from outlast.controller import memory_holds
from outlast.protocol import messages as m
from outlast.storage.records import Manifest

if TYPE_CHECKING:
    from outlast.controller.core import ControllerCore
    from outlast.controller.preemption import Preemption

log = logging.getLogger("outlast.controller")

UPLOAD_TIMEOUT_S = 3600.0  # a whole checkpoint at storage's speed


@dataclass
class Durable:
    """A checkpoint committed in memory for a notice, on its way to storage."""

    holders: dict[int, list[str]]  # rank -> nodes to upload its files from, in the order to try them
    manifest: Manifest | None = None  # once written (durable: false)
    left: set[int] = field(default_factory=set)
    asked: dict[int, tuple[str, int]] = field(default_factory=dict)  # rank -> (node, request id) in flight
    failed: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0  # the slowest rank's upload


def decide(c: "ControllerCore", p: "Preemption") -> tuple[bool, str]:
    """Whether the notice's checkpoint goes to a peer's memory first, and why (or why not)."""
    a = c.attempt
    if c.plan.checkpoint_storage != memory_holds.STORAGE or a is None:
        return False, "the run keeps its checkpoints in memory only"
    bare = sorted({n for n in a.placement.values() if not memory_holds.tier_of(c, n)})
    if bare:
        return False, f"node{'s' * (len(bare) > 1)} {', '.join(bare)} keep{'s' * (len(bare) == 1)} no checkpoint memory"
    for node in sorted(set(a.placement.values())):  # every rank's files need a second node
        peer, _, why = memory_holds.peer_for(c, node)
        if not peer:
            return False, why
    return True, "every node keeps checkpoint memory and has a peer in another failure domain that is not draining"


def peer_rate(c: "ControllerCore", node_id: str) -> float:
    """Bytes per second of the node's last replica to a peer; 0 until one is measured."""
    return c.peer_bps.get(node_id, 0.0)


def is_through_peer(c: "ControllerCore", attempt: int, index: int) -> bool:
    return (attempt, index) in c.through_peer


def upload_after(c: "ControllerCore", h: memory_holds.Holding) -> None:
    """The checkpoint is held on two nodes: upload it once its manifest is written (`after_commit`)."""
    draining = {n.node_id for n in c.nodes.nodes.values() if n.state == "draining"}
    holders = {rank: sorted(nodes, key=lambda n: (n in draining, n != h.node_of.get(rank), n))
               for rank, nodes in h.holders.items() if h.files.get(rank)}
    c.durable[h.checkpoint_dir] = Durable(holders)


def in_flight(c: "ControllerCore") -> set[str]:
    return set(c.durable)


def after_commit(c: "ControllerCore", manifest: Manifest) -> None:
    d = c.durable.get(manifest.checkpoint_dir)
    if d is None or d.manifest is not None:
        return
    d.manifest = manifest
    d.left = set(d.holders)
    if not d.left:
        c.durable.pop(manifest.checkpoint_dir)
        return
    for rank in sorted(d.holders):
        _ask(c, d, rank)


def on_timers(c: "ControllerCore") -> None:
    """An upload whose node is lost never answers: it goes on from the rank's next holder."""
    for d in list(c.durable.values()):
        for rank, (node, ask_id) in sorted(d.asked.items()):
            if not c.nodes.reachable(node):
                c.tier_asks.pop(ask_id, None)
                del d.asked[rank]
                d.failed[rank] = f"{node}, which was uploading its files, is gone"
                log.warning("checkpoint %s rank %d: %s", d.manifest.checkpoint_dir if d.manifest else "?", rank,
                            d.failed[rank])
                _ask(c, d, rank)


def _ask(c: "ControllerCore", d: Durable, rank: int) -> None:
    assert d.manifest is not None
    name = d.manifest.checkpoint_dir
    nodes = [n for n in d.holders[rank] if memory_holds.tier_of(c, n)]
    if not nodes:
        d.left.discard(rank)
        d.failed[rank] = d.failed.get(rank) or "no node that holds its files is left"
        _settle(c, d)
        return
    node, d.holders[rank] = nodes[0], nodes[1:]
    # Ranks share the directory: where two wrote one file, the lowest rank's copy is the one the manifest
    # names, so it alone replaces.
    up = m.TierUpload(run=memory_holds.run_key(c), checkpoint_dir=name, rank=rank, replace=rank == min(d.holders))

    def answered(c: "ControllerCore", e: fx.TierAnswered) -> None:
        d.asked.pop(rank, None)
        stored = e.reply if isinstance(e.reply, m.TierStored) else None
        if stored is None or not stored.ok:
            why = stored.reason if stored is not None else e.error
            log.warning("checkpoint %s rank %d: %s", name, rank, why)
            d.failed[rank] = why
            _ask(c, d, rank)
            return
        d.failed.pop(rank, None)
        d.seconds = max(d.seconds, stored.seconds)
        log.info("checkpoint %s rank %d: uploaded from the memory of %s (%.1f MB in %.1f s)", name, rank,
                 stored.node_id, stored.nbytes / 1e6, stored.seconds)
        d.left.discard(rank)
        _settle(c, d)

    d.asked[rank] = (node, memory_holds.ask_tier(c, node, memory_holds.tier_of(c, node), up, answered,
                                                 UPLOAD_TIMEOUT_S))


def _settle(c: "ControllerCore", d: Durable) -> None:
    if d.left or d.manifest is None:
        return
    name = d.manifest.checkpoint_dir
    if d.failed:
        c.durable.pop(name, None)
        text = (f"checkpoint {name} stays committed in memory only: "
                + "; ".join(f"rank {r}: {why}" for r, why in sorted(d.failed.items())))
        log.warning("%s", text)
        c.book.note_once(text, c.wall())
        _finish_if_settled(c)
        return
    manifest = msgspec.structs.replace(d.manifest, durable=True)
    c.ask_storage(lambda i: fx.WriteManifest(i, manifest), lambda c, done: _durable(c, d))


def _durable(c: "ControllerCore", d: Durable) -> None:
    assert d.manifest is not None
    name = d.manifest.checkpoint_dir
    c.durable.pop(name, None)
    c.book.note_durable(name)
    text = (f"checkpoint {name}, committed in memory for the drain, is durable: every rank's files were uploaded "
            f"from the memory of the nodes that hold them ({d.seconds:.1f} s)")
    log.info("%s", text)
    c.book.note_once(text, c.wall())
    _finish_if_settled(c)


def _finish_if_settled(c: "ControllerCore") -> None:
    from outlast.controller import on_workers

    if c.attempt is not None:
        on_workers.finish_if_settled(c, c.attempt)
