"""Kill to training again: a worker, the fork server, or the embedded node's agent, killed mid-run.

    .venv/bin/python -m bench.node_restarts [--repeat N]

Each run trains 2 DDP ranks (gloo, 50 ms steps, a checkpoint every 5 steps) on the node
that fit() starts for itself; rank 1 sends SIGKILL once at step 12. The figure is the
time from the kill to the first step both ranks finish in the next attempt (their
restore included). Prints one JSON document; ratio = that kill's median / a worker kill's.
Ray Train has no counterpart to time here: on a one-node Ray cluster, a killed raylet
ends the cluster and the run with it.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import psutil

from bench.lib import node_restart_scenario
from bench.lib.venvs import with_root


def one(kind: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = with_root({**os.environ, "OUTLAST_HOME": os.path.join(tmp, "home")})
        env.pop("OUTLAST_ADDRESS", None)
        t0 = time.monotonic()
        kill_t, trained_t = node_restart_scenario.run(kind, sys.executable, tmp, env, 600)
        return {"kill_to_training_s": trained_t - kill_t, "run_wall_s": time.monotonic() - t0}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    kinds = ["worker", "forkserver", "agent"]
    samples = {k: [] for k in kinds}
    for i in range(a.repeat):
        for kind in kinds:  # interleaved, so load changes hit every kind alike
            samples[kind].append(one(kind))
            print(f"[{i + 1}/{a.repeat}] {kind}: {samples[kind][-1]['kill_to_training_s']:.2f} s", file=sys.stderr)
    out = {"benchmark": "node_restarts", "repeat": a.repeat, "cpus": os.cpu_count(),
           "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
           "results": {}}
    base = statistics.median(s["kill_to_training_s"] for s in samples["worker"])
    for kind in kinds:
        xs = [s["kill_to_training_s"] for s in samples[kind]]
        out["results"][kind] = {"kill_to_training_s": {"median": round(statistics.median(xs), 3),
                                                       "min": round(min(xs), 3), "max": round(max(xs), 3)},
                                "ratio_to_worker_kill": round(statistics.median(xs) / base, 2)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
