"""The cluster kept in etcd against the single head, on one machine.

    .venv/bin/python -m bench.etcd [--repeat 3] [--reports 2000] [--out bench/results/etcd.json]

A 3-member etcd on loopback (--heartbeat-interval 100 --election-timeout 1000) and LocalClusters of
agents without preloaded modules, lease TTL 2 s. Figures, each repeated (median and range):

- handover_s: SIGKILL of the agent holding the head role -> another agent holds it, as the table
  of a live agent says (polled every 10 ms). The single head has no figure: nobody takes over.
- drain_latency_s (etcd / head): DrainNode to a live agent -> the drained node's own agent says it
  is draining (polled every 5 ms), the path a run's notice takes. Through etcd: a put, the target's
  watch, its next loop turn; through the head: its message to the member.
- report_us (etcd / head): one report() without a checkpoint, timed inside a 2-rank run's worker;
  the report path makes no etcd call (tests/unit/test_report_path_has_no_store.py), so the two
  should match within noise.

Ray 2.60 is not run here: its GCS has no hand-over without an external Redis, and its drain path is
measured in bench/preemption.py. One JSON document on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.harness import load, machine, publish, ratio, stamp, summary
from outlast.protocol import messages as m
from outlast.testing import LocalCluster
from tests.integration.etcd_cluster import EtcdCluster


def progress(text: str) -> None:
    print(f"[etcd] {text}", file=sys.stderr, flush=True)


def wait(predicate, timeout_s: float, poll_s: float) -> float | None:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if predicate():
            return time.perf_counter() - start
        time.sleep(poll_s)
    return None


def holder(cluster: LocalCluster) -> str | None:
    try:
        return next((n.node_id for n in cluster.node_table() if n.is_head and n.state != "dead"), None)
    except Exception:  # noqa: BLE001 - a node mid-stop: ask again
        return None


def handovers(etcd: EtcdCluster, workdir: Path, repeat: int) -> list[float | None]:
    out = []
    with LocalCluster(num_nodes=repeat + 1, etcd=etcd.urls, workdir=workdir) as cluster:
        for i in range(repeat):
            wait(lambda: holder(cluster) is not None, 30, 0.05)
            old = holder(cluster)
            cluster.kill_node(old)
            out.append(wait(lambda: holder(cluster) not in (None, old), 30, 0.01))  # noqa: B023 - called before the loop goes on
            progress(f"hand-over {i + 1}: {old} -> {holder(cluster)} in {out[-1]}")
    return out


def drained(cluster: LocalCluster, node_id: str) -> bool:
    reply = cluster._request(cluster.nodes[node_id].address, m.StatusRequest())
    return isinstance(reply, m.StatusReply) and reply.draining is not None


def drain_latencies(cluster: LocalCluster, repeat: int) -> list[float | None]:
    out = []
    for i in range(repeat):
        target = f"node-{i + 1}"
        start = time.perf_counter()
        cluster.drain_node(target, deadline_s=60)
        left = wait(lambda: drained(cluster, target), 30, 0.005)  # noqa: B023 - called before the loop goes on
        out.append(None if left is None else time.perf_counter() - start)
    return out


def report_costs(workdir: Path, n: int) -> list[float]:
    from bench.lib.etcd_report_loop import timed_reports
    from outlast.train import RunConfig, ScalingConfig, Trainer

    out = workdir / f"costs-{time.monotonic_ns()}.json"
    Trainer(timed_reports, train_loop_config={"n": n, "out": str(out)}, scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name=f"r{time.monotonic_ns()}", storage_path=str(workdir / "storage"))).fit()
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--reports", type=int, default=2000)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ["OUTLAST_HOME"] = tempfile.mkdtemp(prefix="outlast-bench-etcd-home-")
    load_before = load()
    with tempfile.TemporaryDirectory(prefix="outlast-bench-etcd-") as tmp:
        work = Path(tmp)
        etcd = EtcdCluster(work / "etcd").start()
        try:
            progress("hand-overs")
            handover = handovers(etcd, work / "handover", args.repeat)
            progress("drains and reports")
            drains: dict[str, list] = {"etcd": [], "head": []}
            reports: dict[str, list] = {"etcd": [], "head": []}
            for kind in ("head", "etcd"):
                with LocalCluster(num_nodes=args.repeat + 1, workdir=work / kind,
                                  etcd=etcd.urls if kind == "etcd" else None) as cluster:
                    cluster.wait_ready()
                    for _ in range(args.repeat):
                        costs = report_costs(work / kind, args.reports)
                        reports[kind].append(sorted(costs)[len(costs) // 2] * 1e6)
                    drains[kind] = drain_latencies(cluster, args.repeat)
                progress(f"{kind}: drains {drains[kind]}, report medians (us) {reports[kind]}")
        finally:
            etcd.stop()
    doc = {
        "benchmark": "etcd", "when": stamp(), "load_before": load_before, "load_after": load(),
        "machine": machine({"etcd": "3.4 (Debian)"}),
        "params": {"repeat": args.repeat, "reports": args.reports, "lease_ttl_s": 2, "etcd_members": 3},
        "handover_s": summary(handover),
        "drain_latency_s": {"etcd": summary(drains["etcd"]), "head": summary(drains["head"]),
                            "etcd_over_head": ratio(summary(drains["etcd"]), summary(drains["head"]))},
        "report_us": {"etcd": summary(reports["etcd"]), "head": summary(reports["head"]),
                      "etcd_over_head": ratio(summary(reports["etcd"]), summary(reports["head"]))},
    }
    publish(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
