"""How the controller's cost grows with the ranks: the real controller core, stepped in-process by
simulated workers (no processes, no sockets), for 8 to 4,096 ranks on 1 to 512 nodes.

Per size, median and range over --repeat runs:
- cpu_us_per_report: controller CPU per report() without a checkpoint (one rank's message);
- cpu_ms_per_commit: controller CPU per checkpoint every rank contributes a shard to (all its
  reports, the manifest and the run state written to in-memory storage);
- drain_to_notice_ms: controller CPU from a node's drain to the notice sent to the last rank,
  every rank asking once (what the controller adds to a notice's way);
- failure_to_restart_ms: controller CPU from a rank's failure, through every rank's exit, to the
  next attempt's spawn orders;
- idle_cpu_fraction: the share of one core the controller spends per second on a run that only
  heartbeats (every node answers twice a second);
- peak_mib: Python memory the controller holds at its peak (tracemalloc).

Ray Train's controller polls every worker every 2 s (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S), so its
idle cost grows with workers; outlast's controller hears one answer per node per heartbeat and
each worker only when it reports, so it grows with nodes and with reports. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc

import outlast.sim  # noqa: F401  (loads the controller in the order the training API does)
from outlast.controller import group as g
from outlast.controller.core import ControllerCore
from outlast.controller.runstate import RunBook
from outlast.controller.types import RunPlan, Timeouts
from outlast.protocol import messages as m
from outlast.sim.run import quiet
from outlast.sim.storage import SimStorage
from outlast.storage.run_store import RunStore

SIZES = [(8, 1), (64, 8), (512, 64), (4096, 512)]
ENTRY = m.FileEntry("shard.bin", 1, "0" * 64)


class Bench:
    def __init__(self, ranks: int, nodes: int) -> None:
        self.now = 0.0
        self.ranks, self.nodes = ranks, nodes
        storage = SimStorage(lambda: self.now)
        book = RunBook.open(RunStore(storage, "run"), "bench", 1.0)
        per_node = -(-ranks // nodes)
        plan = RunPlan(name="bench", book=book, world_size=ranks,
                       workers=[m.WorkerSpec(rank=r, local_rank=0, local_world_size=1, node_rank=0, world_size=ranks)
                                for r in range(ranks)],
                       payload=b"", max_failures=-1, num_to_keep=2, score_attribute=None, score_order="max", env={},
                       cwd="/", sys_path=[], timeouts=Timeouts(node_lost_after_s=1e9), per_worker={"CPU": 1.0},
                       strategy="PACK")
        self.core = ControllerCore(plan, "bench", "bench://controller", wall=lambda: 1e9 + self.now)
        self.table = [m.NodeInfo(node_id=f"n{i}", address=f"bench://n{i}", host=f"n{i}",
                                 resources={"CPU": float(per_node)}) for i in range(nodes + 1)]  # one spare
        self.step(g.NodeTable(self.table))
        self.step(g.Started())
        self.reports = 0

    def step(self, event, dt: float = 0.0) -> list[g.Effect]:
        self.now += dt
        return self.core.step(event, self.now)

    def worker(self, msg) -> list[g.Effect]:
        return self.step(g.FromWorker(msg))

    def attempt(self) -> int:
        return self.core.attempt.number

    def start(self) -> None:
        for r in range(self.ranks):
            self.worker(m.WorkerHello(attempt=self.attempt(), rank=r, pid=r))

    def report_round(self, checkpoint: bool) -> None:
        a, i = self.attempt(), self.reports
        self.reports += 1
        name = f"checkpoint_{a:03d}_{i:06d}"
        for r in range(self.ranks):
            self.worker(m.Report(attempt=a, rank=r, index=i, metrics={"step": i}, checkpoint_dir=name if checkpoint
                                 else None, files=[m.FileEntry(f"shard_{r}.bin", 1, "0" * 64)] if checkpoint else []))


def cpu(fn) -> float:
    began = time.process_time()
    fn()
    return time.process_time() - began


def measure(ranks: int, nodes: int) -> dict:
    b = Bench(ranks, nodes)
    b.start()
    rounds = max(2, 4096 // ranks)
    per_report = cpu(lambda: [b.report_round(False) for _ in range(rounds)]) / (rounds * ranks)
    commits = max(1, 512 // ranks)
    per_commit = cpu(lambda: [b.report_round(True) for _ in range(commits)]) / commits
    # Idle: ten seconds of ticks and node answers, nothing else.
    placement = b.core.attempt.placement
    used = sorted(set(placement.values()))

    def idle() -> None:
        for _ in range(100):
            b.step(g.Tick(), dt=0.1)
            if round(b.now * 10) % 5 == 0:
                for n in used:
                    b.step(g.FromAgent(n, m.Pong(node_id=n, pid=0)))
    idle_fraction = cpu(idle) / 10.0
    # Every rank holds a grant; then a drain of rank 0's node and every rank asking once.
    for r in range(ranks):
        b.worker(m.PreemptionQuery(attempt=b.attempt(), rank=r, index=0))
    b.step(g.Tick(), dt=1.0)
    drained = placement[0]

    def drain() -> None:
        b.step(g.FromAgent(drained, m.NodeDraining(node_id=drained, reason="bench", message="",
                                                   deadline_unix_s=1e9 + b.now + 600)))
        for r in range(ranks):
            b.worker(m.PreemptionQuery(attempt=b.attempt(), rank=r, index=1))
    drain_cpu = cpu(drain)
    # A rank fails; every rank exits; the next attempt is placed (on the table as it is).
    a = b.attempt()

    def fail_and_restart() -> None:
        b.step(g.FromAgent(placement[1], m.WorkerExited(run_id="bench", attempt=a, rank=1, pid=1, exit_code=1,
                                                        signal=None, error=None, node_id=placement[1])))
        for r in range(ranks):
            if r != 1:
                b.step(g.FromAgent(placement[r], m.WorkerExited(run_id="bench", attempt=a, rank=r, pid=r,
                                                                exit_code=None, signal=15, error=None,
                                                                node_id=placement[r])))
        b.step(g.NodeTable(b.table))
    restart_cpu = cpu(fail_and_restart)
    assert b.core.attempt.number == a + 1 and b.core.state.kind.value == "scheduling", b.core.state
    return {"cpu_us_per_report": per_report * 1e6, "cpu_ms_per_commit": per_commit * 1e3,
            "drain_to_notice_ms": drain_cpu * 1e3, "failure_to_restart_ms": restart_cpu * 1e3,
            "idle_cpu_fraction": idle_fraction}


def peak_mib(ranks: int, nodes: int) -> float:
    tracemalloc.start()
    b = Bench(ranks, nodes)
    b.start()
    for _ in range(3):
        b.report_round(True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2 ** 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-ranks", type=int, default=4096)
    args = p.parse_args()
    quiet()
    out = {"benchmark": "controller_scale", "sizes": []}
    for ranks, nodes in SIZES:
        if ranks > args.max_ranks:
            continue
        runs = [measure(ranks, nodes) for _ in range(args.repeat)]
        row = {"ranks": ranks, "nodes": nodes, "peak_mib": round(peak_mib(ranks, nodes), 2)}
        for key in runs[0]:
            values = sorted(r[key] for r in runs)
            row[key] = {"median": round(statistics.median(values), 4), "min": round(values[0], 4),
                        "max": round(values[-1], 4)}
        out["sizes"].append(row)
    first, last = out["sizes"][0], out["sizes"][-1]
    growth = last["ranks"] / first["ranks"]
    out["growth"] = {
        "ranks_x": growth,
        **{f"{k}_x": round(last[k]["median"] / first[k]["median"], 2) if first[k]["median"] else None
           for k in ("cpu_ms_per_commit", "drain_to_notice_ms", "failure_to_restart_ms", "idle_cpu_fraction")},
        "cpu_us_per_report_x": round(last["cpu_us_per_report"]["median"] / first["cpu_us_per_report"]["median"], 2),
        "peak_mib_x": round(last["peak_mib"] / first["peak_mib"], 2),
    }
    out["ray_note"] = ("Ray Train's controller polls every worker every 2 s (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S); "
                       "outlast's is event-driven: one answer per node per heartbeat, each worker heard when it "
                       "reports. Ray was not run here: this measures outlast's controller alone.")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
