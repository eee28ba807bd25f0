"""What the commit machine sees of the controller: a frozen view, made by the core for each step.

The machine never reads the core. What it needs of the run as it is now comes in with each
event: the attempt and where its ranks are, the nodes and their memory tiers, the level the
run commits at, and the checkpoints its history names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from outlast.storage.memtier import PeerCandidate, choose_peer
from outlast.storage.records import CheckpointRecord

STORAGE, MEMORY = "storage", "memory"  # CheckpointConfig(checkpoint_storage=...): the level a commit reaches


@dataclass(frozen=True)
class NodeFacts:
    node_id: str
    tier_address: str  # its memory tier's server, as the node table has it ("": it keeps none)
    tier: str  # the same while this driver can reach the node, else "": its copies and answers are gone
    failure_domain: str
    draining: bool
    reachable: bool  # alive in the table, and not lost by this driver


@dataclass(frozen=True)
class View:
    attempt: int | None  # the attempt running now
    placement: Mapping[int, str]  # its ranks' nodes
    nodes: Mapping[str, NodeFacts]  # the node table, in its order
    level: str  # STORAGE or MEMORY
    duplicate_files: str  # file_merge.DuplicateFiles: ranks that wrote one file differently
    records: tuple[CheckpointRecord, ...]  # the committed checkpoints the history names
    run_key: str  # the run as the tiers and restores name it, the same across its drivers
    head_lost: str | None  # why the cluster's head is gone, or None
    wall: float  # the wall clock now, for what is recorded

    def tier_of(self, node_id: str) -> str:
        """The node's tier, while this driver can reach the node."""
        node = self.nodes.get(node_id)
        return node.tier if node is not None else ""

    def peer_for(self, node_id: str) -> tuple[str, str, str]:
        """(peer node, its tier's address, why) for the replica of `node_id`'s copies."""
        candidates = [PeerCandidate(n.node_id, n.failure_domain, alive=n.reachable, draining=n.draining)
                      for n in self.nodes.values() if n.tier_address or n.node_id == node_id]
        choice = choose_peer(node_id, candidates)
        if choice.node_id is None:
            return "", "", choice.reason
        return choice.node_id, self.nodes[choice.node_id].tier_address, choice.reason

    def draining(self) -> set[str]:
        return {n.node_id for n in self.nodes.values() if n.draining}

    def domains(self) -> dict[str, str]:
        """Node -> its failure domain (a node without one is a domain of its own)."""
        return {n.node_id: n.failure_domain or f"node:{n.node_id}" for n in self.nodes.values()}
