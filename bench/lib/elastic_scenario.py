"""outlast side of the elastic benchmark: a node lost with no spare, then a node added.

    .venv/bin/python -m bench.lib.elastic_scenario [--repeats 3] [--lose-step 30]

The shape of Ray's `ray.cluster_utils.Cluster` in bench/lib/ray_elastic_scenario.py: a head that
takes no workers (--num-cpus 0) and two 1-CPU worker nodes with warm fork servers (torch
imported). A TorchTrainer with ScalingConfig(num_workers=(1, 2)), one CPU per worker, runs
a loop that sleeps ~20 ms, all-reduces one number over gloo (lock step, as DDP),
calls get_preemption_info(), reports every step, checkpoints every 10 steps and once more,
just in time, on the first notice.

  lost:  at --lose-step, one worker node is SIGKILLed (a lost machine, no spare):
         kill -> first step at world size 1, and steps lost.
  added: --settle-steps steps after the run trains at size 1, a node is added: add -> first step at world
         size 2, and steps lost (the grow saves first, so none).

Defaults everywhere (node lost after 5 s of silence), except the least time between
resizes: --interval-s (elastic_resize_monitor_interval_s) 0 measures the grow itself; at
the default 60 s a node that joins just after a resize waits out the rest of it.

--live: FailureConfig(live_recovery=True) and a loop that steps a one-layer model through
`LiveTraining` (its gradients all-reduced in the live group, lock step): the lost node shrinks the
group in the same processes (the step in flight thrown away: `lost_steps_lost` is the steps the
history says were lost, not trained again), and the added node grows it back from the running rank's
state, with no checkpoint read. One JSON document on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

from bench.lib import step_checkpoint
from bench.lib.clusters import head_and_workers
from bench.lib.elastic_loop import train_steps
from bench.lib.events import emit, read_events
from bench.lib.harness import load, summarize_runs


def log(msg: str) -> None:
    print(f"[elastic {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def train_loop_per_worker(config: dict) -> None:
    from outlast import train

    events = config["events"]
    ctx = train.get_context()
    rank, world, attempt = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_attempt()
    restored_from = step_checkpoint.restored_step(train)
    start = 0 if restored_from is None else restored_from + 1
    emit(events, ev="attempt_start", rank=rank, world=world, attempt=attempt, restored_from=restored_from,
         t=time.time())
    # The grown attempt (the third) trains 40 steps and the run ends.
    last = start + 40 if attempt >= 3 and world == 2 else config["steps"]
    train_steps(train, events, range(start, last), config["step_s"], rank, world=world, attempt=attempt)


def live_loop_per_worker(config: dict) -> None:
    import torch

    from outlast import train
    from outlast.train.torch import LiveTraining

    events = config["events"]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    live = LiveTraining(model, torch.optim.SGD(model.parameters(), lr=0.01))
    step = live.start()
    ctx = train.get_context()
    emit(events, ev="attempt_start", rank=ctx.get_world_rank(), world=ctx.get_world_size(),
         attempt=ctx.get_attempt(), restored_from=None, t=time.time())
    grown_at = None  # the run ends 40 steps after it grew back (generation 2: the shrink's is 1), on every rank
    while True:
        if grown_at is None and live.generation >= 2:  # the same step on every rank, the one that joined too
            grown_at = step
        if grown_at is not None and step >= grown_at + 40:
            break
        time.sleep(config["step_s"])
        model(torch.ones(1, 4)).sum().backward()
        done = live.step(step)
        ctx = train.get_context()
        if done > step:  # not thrown away by the shrink
            emit(events, ev="step", rank=ctx.get_world_rank(), step=step, t=time.time(), world=ctx.get_world_size(),
                 attempt=ctx.get_attempt())
            train.report({"step": step})
        step = done
    live.close()


def once(args) -> dict:
    from outlast.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from outlast.train.torch import TorchTrainer

    work = tempfile.mkdtemp(prefix="outlast-elastic-")
    events = os.path.join(work, "events.jsonl")
    marks: dict = {}
    with head_and_workers(work) as (cluster, _):
        def faults():
            while not any(e["ev"] == "step" and e["world"] == 2 and e["step"] >= args.lose_step
                          for e in read_events(events)):
                time.sleep(0.01)
            marks["last_step_before_kill"] = max(e["step"] for e in read_events(events) if e["ev"] == "step")
            marks["kill_t"] = time.time()
            cluster.kill_node("node-2")
            log("killed node-2")
            while sum(e["ev"] == "step" and e["world"] == 1 for e in read_events(events)) < args.settle_steps:
                time.sleep(0.01)
            marks["add_t"] = time.time()
            cluster.add_node("node-3", extra_args=["--num-cpus", "1"])
            marks["added_t"] = time.time()
            log("added node-3")

        threading.Thread(target=faults, daemon=True).start()
        TorchTrainer(
            live_loop_per_worker if args.live else train_loop_per_worker,
            train_loop_config={"events": events, "step_s": 0.02, "steps": 10**9},
            scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1},
                                         elastic_resize_monitor_interval_s=args.interval_s),
            # The live shrink is a lost node's failure, charged as its restart would be; a restart's shrink is not.
            run_config=RunConfig(name="elastic", storage_path=os.path.join(work, "storage"),
                                 failure_config=FailureConfig(max_failures=1 if args.live else 0,
                                                              live_recovery=args.live),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)),
        ).fit()
    return figures(read_events(events), marks, work, args.live)


def figures(evs: list[dict], marks: dict, work: str, live: bool = False) -> dict:
    state = json.load(open(os.path.join(work, "storage", "elastic", "run_state.json")))
    out: dict = {"resizes": [(r["from_workers"], r["to_workers"], r["steps_lost"]) for r in state["resizes"]],
                 "failures_charged": state["failure_counts"].get("worker", 0), "attempts": len(state["attempts"])}
    if live:
        out["live_recoveries"] = [(r["path"], r["cause"].split(":")[0], r["steps_lost"])
                                  for r in state["live_recoveries"]]
        small = [e for e in evs if e["ev"] == "step" and e["world"] == 1]
        grown = [e for e in evs if e["ev"] == "step" and e["world"] == 2 and e["t"] > marks.get("add_t", 1e18)]
        if small and "kill_t" in marks:
            out["lost_to_training_at_smaller_size_s"] = min(e["t"] for e in small) - marks["kill_t"]
            out["lost_steps_lost"] = sum(r["steps_lost"] for r in state["resizes"] if r["to_workers"] == 1)
        if grown:
            out["added_to_training_at_larger_size_s"] = min(e["t"] for e in grown) - marks["add_t"]
            out["node_join_s"] = marks["added_t"] - marks["add_t"]
            out["added_steps_lost"] = sum(r["steps_lost"] for r in state["resizes"] if r["to_workers"] == 2)
        return out
    small = [e for e in evs if e["ev"] == "step" and e["world"] == 1]
    if small and "kill_t" in marks:
        out["lost_to_training_at_smaller_size_s"] = min(e["t"] for e in small) - marks["kill_t"]
        restored = next((e["restored_from"] for e in evs if e["ev"] == "attempt_start" and e["world"] == 1), None)
        out["lost_steps_lost"] = marks["last_step_before_kill"] - (restored if restored is not None else -1)
    grown = [e for e in evs if e["ev"] == "step" and e["world"] == 2 and e["t"] > marks.get("add_t", 1e18)]
    if grown:
        out["added_to_training_at_larger_size_s"] = min(e["t"] for e in grown) - marks["add_t"]
        out["node_join_s"] = marks["added_t"] - marks["add_t"]
        before = max(e["step"] for e in evs if e["ev"] == "step" and e["world"] == 1)
        restored = [e["restored_from"] for e in evs if e["ev"] == "attempt_start" and e["world"] == 2
                    and e["t"] > marks["add_t"]]
        out["added_steps_lost"] = before - restored[0] if restored else None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lose-step", type=int, default=30)
    p.add_argument("--settle-steps", type=int, default=5, help="steps at world size 1 before the node is added")
    p.add_argument("--interval-s", type=float, default=0.0, help="elastic_resize_monitor_interval_s")
    p.add_argument("--live", action="store_true", help="live recovery: shrink and grow in the same processes")
    args = p.parse_args()
    runs = []
    for i in range(args.repeats):
        log(f"repeat {i + 1} of {args.repeats}")
        runs.append(once(args))
    numeric = [{k: v for k, v in r.items() if isinstance(v, (int, float))} for r in runs]
    print(json.dumps({"framework": "outlast", "live": args.live, "interval_s": args.interval_s,
                      "load_before_after": load(), "runs": runs,
                      "figures": summarize_runs(numeric)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
