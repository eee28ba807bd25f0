"""Where each rank runs: a pure decision over the nodes that can take work.

Ranks are numbered so that `torch.distributed` sees what it expects: the ranks of a
node are consecutive, node ranks follow the order nodes are used in, and local ranks
count from 0 on every node.
"""

from __future__ import annotations

from dataclasses import dataclass

from outlast.protocol.messages import WorkerSpec


@dataclass(frozen=True)
class NodeView:
    node_id: str
    address: str
    resources: dict[str, float]  # what is free now, e.g. {"CPU": 8, "GPU": 0, "memory": 3e10}
    draining: bool = False


@dataclass(frozen=True)
class Placement:
    workers: list[tuple[NodeView, WorkerSpec]]


@dataclass(frozen=True)
class NoCapacity:
    reason: str


def _fits(free: dict[str, float], need: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) >= v for k, v in need.items())


def _take(free: dict[str, float], need: dict[str, float]) -> None:
    for k, v in need.items():
        free[k] = free.get(k, 0.0) - v


def place(nodes: list[NodeView], num_workers: int, per_worker: dict[str, float],
          strategy: str = "PACK") -> Placement | NoCapacity:
    """PACK fills a node before using the next; SPREAD deals ranks round-robin over nodes.

    STRICT_PACK needs one node for all ranks; STRICT_SPREAD one node per rank. Draining
    nodes never get new work.
    """
    usable = sorted((n for n in nodes if not n.draining), key=lambda n: n.node_id)
    free = {n.node_id: dict(n.resources) for n in usable}
    chosen: list[NodeView] = []
    if strategy == "STRICT_PACK":
        need = {k: v * num_workers for k, v in per_worker.items()}
        chosen = next(([n] * num_workers for n in usable if _fits(free[n.node_id], need)), [])
    elif strategy == "PACK":
        for node in usable:
            while len(chosen) < num_workers and _fits(free[node.node_id], per_worker):
                _take(free[node.node_id], per_worker)
                chosen.append(node)
    else:
        progress = True
        while len(chosen) < num_workers and progress:
            progress = False
            for node in usable:
                if len(chosen) < num_workers and _fits(free[node.node_id], per_worker) and not (
                        strategy == "STRICT_SPREAD" and node in chosen):
                    _take(free[node.node_id], per_worker)
                    chosen.append(node)
                    progress = True
    if len(chosen) < num_workers:
        draining = sum(1 for n in nodes if n.draining)
        return NoCapacity(
            f"{num_workers} workers needing {per_worker or 'nothing'} each do not fit on the "
            f"{len(usable)} usable node(s) with {strategy}" + (f" ({draining} draining)" if draining else "")
        )
    # Group by node in first-use order so that ranks on a node are consecutive.
    counts: dict[str, int] = {}  # dicts keep first-use order
    for n in chosen:
        counts[n.node_id] = counts.get(n.node_id, 0) + 1
    by_id = {n.node_id: n for n in usable}
    workers, rank = [], 0
    for node_rank, nid in enumerate(counts):
        for local_rank in range(counts[nid]):
            workers.append((by_id[nid], WorkerSpec(rank=rank, local_rank=local_rank, local_world_size=counts[nid],
                                                   node_rank=node_rank, world_size=num_workers)))
            rank += 1
    return Placement(workers)
