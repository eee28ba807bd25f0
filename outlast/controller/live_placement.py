"""Where a live recovery forks the replacement of a rank whose node is lost: a pure decision over the nodes that
can take work, as `placement.py` makes it for a whole attempt.

The other ranks keep their nodes, so only the lost rank moves. A node has room when what it has free, less
what this run's living ranks there hold, fits one more rank. SPREAD (and STRICT_SPREAD, which needs a node
without a rank of the run) takes the node with the fewest of the run's ranks, a spare node first; PACK takes
the node with the most of them that has room, so the run stays on as few nodes as it can; STRICT_PACK needs
the node every other rank is on. Ties go to the lowest node id, as `placement.place` deals nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from outlast.controller.placement import NodeView, NoCapacity


@dataclass(frozen=True)
class Moved:
    node_id: str
    reason: str


def replacement_node(nodes: list[NodeView], held: dict[str, int], per_worker: dict[str, float],
                     strategy: str) -> Moved | NoCapacity:
    """`held`: node id -> how many living ranks of this run are on it (the lost rank's node is not in `nodes`)."""
    room = []
    for n in sorted((n for n in nodes if not n.draining), key=lambda n: n.node_id):
        count = held.get(n.node_id, 0)
        if all(n.resources.get(k, 0.0) - count * v >= v for k, v in per_worker.items()):
            room.append((count, n.node_id))
    if strategy == "STRICT_SPREAD":
        room = [(c, nid) for c, nid in room if c == 0]
    elif strategy == "STRICT_PACK":
        homes = {nid for nid, c in held.items() if c}
        room = [(c, nid) for c, nid in room if nid in homes and len(homes) == 1]
    if not room:
        usable = sum(1 for n in nodes if not n.draining)
        return NoCapacity(f"no other node has room for one more rank needing {per_worker or 'nothing'} with "
                          f"{strategy} ({usable} usable node(s))")
    count, node_id = min(room, key=lambda r: (r[0], r[1])) if "SPREAD" in strategy else \
        min(room, key=lambda r: (-r[0], r[1]))
    what = "a spare node" if count == 0 else f"a node with {count} of the run's ranks and room for one more"
    return Moved(node_id, f"{node_id}, {what} ({strategy})")
