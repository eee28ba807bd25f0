"""Notice to committed just-in-time checkpoint of 1 GB, on a `LocalCluster` drain.

    .venv/bin/python -m bench.jit_drain [--repeats 3] [--gb 1.0] [--deadline-s 120]
        [--out bench/results/jit-drain.json]

Each repeat: a head that takes no workers and two 1-CPU worker nodes on loopback, each with
a warm fork server (torch imported); one worker whose state dict is one float32 tensor of
--gb GB (random, so nothing compresses) and steps of ~20 ms that ask get_preemption_info().
At step 5 `outlast drain-node --reason preemption --deadline-remaining-seconds N` drains its
node; on the notice the loop does what Ray's guide does: `torch.save` into a temporary
directory, then `train.report(checkpoint=...)` (SYNC: outlast copies it into run storage
with an xxh3 checksum of every file). Storage is a local directory.

Figures, seconds from when the drain command returned (wall clocks of one machine):
the notice on the rank, `torch.save` done, the checkpoint committed (its `committed_at` in
the run's history), the first step on the other node. Median and range over the repeats,
the 1-minute load average with each. One JSON document on stdout (and --out), progress on
stderr. outlast alone: Ray's side of a drain is bench/preemption.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench.lib.events import emit, read_events
from bench.lib.clusters import head_and_workers
from bench.lib.venvs import ROOT


def log(msg: str) -> None:
    print(f"[jit-drain {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def train_loop_per_worker(config: dict) -> None:
    import torch

    from outlast import train

    events = config["events"]
    node = os.environ.get("OUTLAST_NODE_ID")
    if train.get_checkpoint() is not None:  # the restarted attempt: one step on the other node is the figure
        emit(events, ev="restarted_step", node=node, t=time.time())
        return
    state = {"w": torch.rand(int(config["gb"] * 1e9) // 4)}
    for step in range(1, 10**9):
        time.sleep(0.02)
        emit(events, ev="step", step=step, node=node, t=time.time())
        info = train.get_preemption_info()
        if info is None:
            train.report({"step": step})
            continue
        emit(events, ev="notice", step=step, t=time.time())
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(state, os.path.join(tmp, "model.pt"))
            emit(events, ev="saved", step=step, t=time.time())
            train.report({"step": step}, checkpoint=train.Checkpoint.from_directory(tmp))
        return  # the controller restarts the attempt once the checkpoint is in; it stops this one meanwhile


def one_run(i: int, args) -> dict:
    from outlast.train import FailureConfig, RunConfig, ScalingConfig
    from outlast.train.torch import TorchTrainer

    work = tempfile.mkdtemp(prefix=f"outlast-jit-drain-{i}-")
    events = os.path.join(work, "events.jsonl")
    out: dict = {"load_avg_1m_before": os.getloadavg()[0]}
    drained: dict = {}
    with head_and_workers(work) as (cluster, _):
        def drain():
            while not any(e.get("ev") == "step" and e["step"] >= 5 for e in read_events(events)):
                time.sleep(0.01)
            node = next(e["node"] for e in read_events(events) if e.get("ev") == "step")
            done = subprocess.run([sys.executable, "-m", "outlast.cli.main", "drain-node", "--node-id", node,
                                   "--reason", "preemption", "--reason-message", "bench",
                                   "--deadline-remaining-seconds", str(args.deadline_s)],
                                  capture_output=True, text=True, cwd=ROOT)
            drained.update(node=node, t=time.time(), rc=done.returncode)

        threading.Thread(target=drain, daemon=True).start()
        trainer = TorchTrainer(
            train_loop_per_worker, train_loop_config={"events": events, "gb": args.gb},
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="jit", storage_path=os.path.join(work, "storage"),
                                 failure_config=FailureConfig(max_failures=0)))
        trainer.fit()
    with open(os.path.join(work, "storage", "jit", "run_state.json")) as f:
        history = json.load(f)
    evs = read_events(events)
    t0 = drained["t"]
    first = {e["ev"]: e for e in reversed(evs)}
    out.update(drain_rc=drained["rc"], notice_s=first["notice"]["t"] - t0, saved_s=first["saved"]["t"] - t0,
               committed_s=history["checkpoints"][0]["committed_at"] - t0,
               first_step_elsewhere_s=first["restarted_step"]["t"] - t0,
               restarted_on_other_node=first["restarted_step"]["node"] != drained["node"],
               load_avg_1m_after=os.getloadavg()[0])
    subprocess.run(["rm", "-rf", work])
    return out


def summary(runs: list[dict], key: str) -> dict:
    xs = [r[key] for r in runs]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--deadline-s", type=int, default=120)
    p.add_argument("--out")
    args = p.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    runs = []
    for i in range(args.repeats):
        runs.append(one_run(i, args))
        log(json.dumps(runs[-1]))
    keys = ("notice_s", "saved_s", "committed_s", "first_step_elsewhere_s")
    doc = {"checkpoint_gb": args.gb, "deadline_s": args.deadline_s, "repeats": args.repeats,
           "cpus": os.cpu_count(), **{k: summary(runs, k) for k in keys},
           "upload_mb_per_s": summary([{"x": args.gb * 1e3 / (r["committed_s"] - r["saved_s"])} for r in runs], "x"),
           "runs": runs}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
