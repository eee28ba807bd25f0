"""A worker SIGKILL to training again at 8 ranks on 4 nodes: outlast in network namespaces, Ray 2.60 beside it.

    .venv/bin/python -m bench.kill_nodes [--repeats 3] [--ranks 8] [--out bench/results/kill-nodes.json]

The core scenario's kill (bench/lib/core_scenario.py --mode kill: DDP on gloo, an MLP, a checkpoint every
10 steps, rank 1 SIGKILLs itself at step 25), with --ranks ranks at one CPU each on 4 nodes of 2 CPUs:
- outlast: a head in the root namespace and 3 members, each in a network namespace of its own with its
  own address on a bridge (tests/integration/netns.py), every fork server warm (torch imported);
- Ray: `ray.cluster_utils.Cluster`, a head and 3 nodes on loopback (Ray's local clusters have no
  namespaces; its nodes are processes on one machine as outlast's are).
Each framework's cluster is started once and runs every repeat, interleaved with the other's.

Figure: from the kill to the first step of a rank that did not run before it (every rank steps in
lock step under DDP), and the steps lost. Median and range; the 1-minute load average beside each.
One JSON document on stdout (and --out), progress on stderr. Needs root (namespaces) and bench/.ray-venv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.lib import harness
from bench.lib.events import read_events
from bench.lib.venvs import OUTLAST_PY, RAY_PY, ROOT, module

RAY_CLUSTER = r"""
import sys, time
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
for _ in range(3):
    cluster.add_node(num_cpus=2)
cluster.wait_for_nodes()
print(cluster.address, flush=True)
sys.stdin.read()
cluster.shutdown()
"""


def log(msg: str) -> None:
    print(f"[kill-nodes {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def kill_figures(events: list[dict]) -> dict:
    kill = next((e for e in events if e.get("ev") == "kill"), None)
    if kill is None:
        return {}
    steps = [e for e in events if e.get("ev") == "step"]
    before = {e["pid"] for e in steps if e["t"] <= kill["t"]}
    after = [e for e in steps if e["t"] > kill["t"] and e["pid"] not in before]
    if not after:
        return {}
    first = min(after, key=lambda e: e["t"])
    return {"kill_to_training_s": first["t"] - kill["t"], "steps_lost": kill["step"] - (first["restored_from"] or 0),
            "ranks_after": len({e["rank"] for e in after})}


def one(framework: str, env: dict, address: str | None, ranks: int, workdir: str, i: int) -> dict:
    events = os.path.join(workdir, f"{framework}-{i}.jsonl")
    cmd = module(OUTLAST_PY if framework == "outlast" else RAY_PY, "bench.lib.core_scenario",
                 "--framework", framework, "--mode", "kill", "--events", events, "--workers", str(ranks))
    if address:
        cmd += ["--address", address]
    load = harness.load()
    with open(os.path.join(workdir, f"{framework}-{i}.log"), "w") as out:
        rc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900, cwd=ROOT).returncode
    figs = kill_figures(read_events(events))
    figs.update(rc=rc, load1=load[0])
    log(f"{framework} {i + 1}: {json.dumps(figs)}")
    return figs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--out")
    args = p.parse_args()
    from outlast.client.preload import default_preload
    from tests.integration.netns import NetnsCluster

    workdir = tempfile.mkdtemp(prefix="kill-nodes-")
    runs: dict[str, list[dict]] = {"outlast": [], "ray": []}
    ray_env = dict(os.environ, RAY_TRAIN_V2_ENABLED="1", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    ray = subprocess.Popen([RAY_PY, "-c", RAY_CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           env=ray_env, cwd=workdir)
    try:
        ray_address = ray.stdout.readline().strip()
        log(f"Ray's cluster at {ray_address}")
        cluster = NetnsCluster(num_members=3, workdir=os.path.join(workdir, "netns"), node_timeout_s=3.0,
                               extra_args=["--num-cpus", "2", "--preload", ",".join(default_preload())])
        try:
            cluster.wait_joined()
            outlast_env = {**os.environ, **cluster.env}
            log(f"outlast's cluster: {', '.join(cluster.nodes)}")
            for i, name in harness.interleaved(["outlast", "ray"], args.repeats):
                if name == "outlast":
                    runs[name].append(one(name, outlast_env, None, args.ranks, workdir, i))
                else:
                    runs[name].append(one(name, ray_env, ray_address, args.ranks, workdir, i))
        finally:
            cluster.shutdown()
    finally:
        ray.stdin.close()
        ray.wait(timeout=120)
    by = {name: harness.summarize_runs([{k: v for k, v in r.items() if k != "rc"} for r in rs if r.get("rc") == 0])
          for name, rs in runs.items()}
    doc = {"ranks": args.ranks, "nodes": 4, "repeats": args.repeats, "machine": harness.machine({}),
           "summary": by, "runs": runs,
           "ratio_ray_over_outlast_kill_to_training": harness.ratio(by["ray"].get("kill_to_training_s"),
                                                                    by["outlast"].get("kill_to_training_s"))}
    harness.publish(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
