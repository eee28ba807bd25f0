"""The controller's own cost at a fleet's size: the real `ControllerCore`, stepped in-process by simulated ranks
(no processes, no sockets), through the events a fleet's run lives by: every rank's hello, a round of reports
with a checkpoint, a drain's notice, and a rank's failure through every rank's exit to the next attempt's
spawn orders (the time to decide a restart). CPU per event, and the peak of Python memory it holds."""

from __future__ import annotations

import time
import tracemalloc
from dataclasses import dataclass, replace
from typing import Callable

from outlast.controller import group as g
from outlast.controller.core import ControllerCore
from outlast.controller.runstate import RunBook
from outlast.controller.types import RunPlan, Timeouts
from outlast.protocol import messages as m
from outlast.sim.storage import SimStorage
from outlast.storage.run_store import RunStore

WALL0 = 1_800_000_000.0


@dataclass(frozen=True)
class ControllerCost:
    ranks: int
    nodes: int
    hello_cpu_s: float  # every rank's hello, the attempt's start
    report_round_cpu_s: float  # every rank's report with a checkpoint shard
    cpu_us_per_message: float  # over the two above
    drain_notice_cpu_s: float  # a node's drain notice, every rank asking once
    restart_decision_cpu_s: float  # a rank's failure, every rank's exit, to the next attempt's placing
    peak_mib: float  # Python memory the controller held at its peak (tracemalloc)


class _Driven:
    def __init__(self, nodes: int, ranks_per_node: int) -> None:
        self.now = 0.0
        self.ranks = nodes * ranks_per_node
        storage = SimStorage(lambda: self.now)
        book = RunBook.open(RunStore(storage, "run"), "fleet", 1.0)
        plan = RunPlan(name="fleet", book=book, world_size=self.ranks,
                       workers=[m.WorkerSpec(rank=r, local_rank=r % ranks_per_node, local_world_size=ranks_per_node,
                                             node_rank=r // ranks_per_node, world_size=self.ranks)
                                for r in range(self.ranks)],
                       payload=b"", max_failures=-1, num_to_keep=2, score_attribute=None, score_order="max", env={},
                       cwd="/", sys_path=[], timeouts=Timeouts(node_lost_after_s=1e9), per_worker={"CPU": 1.0},
                       strategy="PACK")
        self.core = ControllerCore(plan, "fleet", "sim://controller", wall=lambda: WALL0 + self.now)
        self.table = [m.NodeInfo(node_id=f"n{i}", address=f"sim://n{i}", host=f"n{i}",
                                 resources={"CPU": float(ranks_per_node)}) for i in range(nodes + 1)]  # one spare
        self.step(g.NodeTable(self.table))
        self.step(g.Started())
        self.reports = 0

    def step(self, event: object, dt: float = 0.0) -> None:
        """The effects go nowhere: what is measured is the controller's deciding, not their carrying out."""
        self.now += dt
        self.core.step(event, self.now)  # type: ignore[arg-type]

    def worker(self, msg: object) -> None:
        self.step(g.FromWorker(msg))  # type: ignore[arg-type]

    @property
    def attempt(self) -> int:
        assert self.core.attempt is not None
        return self.core.attempt.number


def measure(nodes: int, ranks_per_node: int) -> ControllerCost:
    """CPU with nothing watching; the peak in a second pass under tracemalloc, which slows every allocation."""
    cost = _events(nodes, ranks_per_node)
    tracemalloc.start()
    try:
        _events(nodes, ranks_per_node)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return replace(cost, peak_mib=peak / 2 ** 20)


def _events(nodes: int, ranks_per_node: int) -> ControllerCost:
    d = _Driven(nodes, ranks_per_node)
    a = d.attempt
    name = f"checkpoint_{a:03d}_000000"

    def hellos() -> None:
        for r in range(d.ranks):
            d.worker(m.WorkerHello(attempt=a, rank=r, pid=r))

    def reports() -> None:
        for r in range(d.ranks):
            d.worker(m.Report(attempt=a, rank=r, index=0, metrics={"step": 0}, checkpoint_dir=name,
                              files=[m.FileEntry(f"shard_{r}.bin", 1, "0" * 64)]))
    hello = _cpu(hellos)
    rounds = _cpu(reports)
    assert d.core.attempt is not None
    placement = d.core.attempt.placement
    drained = placement[0]

    def drain() -> None:
        d.step(g.FromAgent(drained, m.NodeDraining(node_id=drained, reason="fleet", message="",
                                                   deadline_unix_s=WALL0 + d.now + 600)), dt=1.0)
        for r in range(d.ranks):
            d.worker(m.PreemptionQuery(attempt=a, rank=r, index=1))
    notice = _cpu(drain)

    def fail_and_restart() -> None:
        d.step(g.FromAgent(placement[1], m.WorkerExited(run_id="fleet", attempt=a, rank=1, pid=1, exit_code=1,
                                                        signal=None, error=None, node_id=placement[1])))
        for r in range(d.ranks):
            if r != 1:
                d.step(g.FromAgent(placement[r], m.WorkerExited(run_id="fleet", attempt=a, rank=r, pid=r,
                                                                exit_code=None, signal=15, error=None,
                                                                node_id=placement[r])))
        d.step(g.NodeTable(d.table))
    restart = _cpu(fail_and_restart)
    if d.attempt != a + 1:
        raise RuntimeError(f"the controller did not begin attempt {a + 1} after the failure: it is {d.core.state}")
    return ControllerCost(ranks=d.ranks, nodes=nodes, hello_cpu_s=hello, report_round_cpu_s=rounds,
                          cpu_us_per_message=(hello + rounds) / (2 * d.ranks) * 1e6, drain_notice_cpu_s=notice,
                          restart_decision_cpu_s=restart, peak_mib=0.0)


def _cpu(fn: Callable[[], None]) -> float:
    began = time.process_time()
    fn()
    return time.process_time() - began
