"""What the simulator needs of a node, and the head's node table.

`NodeModel` is met by one class, `AgentNode` (outlast/sim/agent_node.py), which runs the
agent's real core: the simulator has no node logic of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from outlast.protocol import messages as m
from outlast.sim.workers import SimRank

if TYPE_CHECKING:
    from outlast.sim.driver import SimDriver

HEAD_DEAD_AFTER_S = 3.0  # the head declares a silent member dead after this


class NodeModel(Protocol):
    node_id: str
    alive: bool
    agent_pid: int
    workers: dict

    def start(self) -> None: ...

    def kill_worker(self, rank: int) -> SimRank | None: ...

    def wedge_worker(self, rank: int, until: float = 0.0) -> SimRank | None: ...

    def worker_exited(self, w: SimRank, code: int | None, signal: int | None, error: m.WorkerError | None) -> None: ...

    def agent_gone(self) -> str | None: ...

    def from_driver(self, driver: "SimDriver", msg: m.Msg) -> None: ...

    def drain(self, notice: m.NodeDraining) -> None: ...

    def die(self) -> None: ...

    def info(self, now: float) -> m.NodeInfo: ...


def node_table(nodes: list[NodeModel], now: float) -> list[m.NodeInfo]:
    return [n.info(now) for n in nodes]

