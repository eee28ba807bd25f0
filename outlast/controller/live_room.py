"""Where a live move's ranks go: nodes that are not draining, with room beside the ranks the attempt keeps there.

Pure: the node views (`NodeBook.views`, what each node can give this run) and the attempt's placement come in.
"""

from __future__ import annotations

from outlast.controller.placement import NodeView, NoCapacity, place


def where_to(nodes: list[NodeView], placement: dict[int, str], moving: list[int], per_worker: dict[str, float],
             strategy: str) -> dict[int, str] | NoCapacity:
    """A node for each of `moving`, or why there is none. The attempt's other ranks keep what they hold; the
    moving ones are on draining nodes, which take no new work. A strict strategy is read as its loose kind: the
    ranks that stay are where they are, and only the moving ones are placed."""
    held: dict[str, int] = {}
    for rank, node in placement.items():
        if rank not in moving:
            held[node] = held.get(node, 0) + 1
    free = [NodeView(n.node_id, n.address, {k: v - per_worker.get(k, 0.0) * held.get(n.node_id, 0)
                                            for k, v in n.resources.items()}, n.draining) for n in nodes]
    placed = place(free, len(moving), per_worker, "SPREAD" if "SPREAD" in strategy else "PACK")
    if isinstance(placed, NoCapacity):
        return placed
    return {rank: node.node_id for rank, (node, _) in zip(sorted(moving), placed.workers)}
