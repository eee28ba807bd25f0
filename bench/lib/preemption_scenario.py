"""outlast side of the preemption benchmark: drain a node of a LocalCluster under training.

    .venv/bin/python -m bench.lib.preemption_scenario [--variant both|spare|nospare]
        [--drain-step 30] [--deadline-s 20] [--capacity-timeout-s 30]

The same scenario as bench/lib/ray_preemption_scenario.py: a head that takes no workers
(--num-cpus 0) and 2-CPU worker nodes, each with a warm fork server (torch imported);
a TorchTrainer with 2 workers needing 1 CPU each, STRICT_PACK, so both land on one node;
a loop that sleeps ~20 ms, all-reduces one number over gloo (lock step, as DDP), calls
get_preemption_info(), reports every step, checkpoints
every 10 steps and once more, just in time, on the first notice.

When rank 0 reports --drain-step, `outlast drain-node --reason preemption
--deadline-remaining-seconds N` drains the workers' node, and at the deadline this
script kills that node, as a cloud would.

  spare:   head + 2 worker nodes: drain -> notice on every rank, drain -> first step
           on the spare node, steps lost.
  nospare: head + 1 worker node: what the run says and does without anywhere to go.

Times are measured from when the drain command returned, as on Ray's side. One JSON
document on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from bench.lib.clusters import head_and_workers
from bench.lib.events import read_events
from bench.lib.preemption_loop import preemption_loop
from bench.lib.venvs import ROOT


def log(msg: str) -> None:
    print(f"[preempt {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def train_loop_per_worker(config: dict) -> None:
    from outlast import train

    preemption_loop(train, config, os.environ.get("OUTLAST_NODE_ID"),
                    lambda info: {"node_ids": info.node_ids, "ranks": info.ranks})


def run_variant(variant: str, args) -> dict:
    from outlast.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from outlast.train.torch import TorchTrainer

    work = tempfile.mkdtemp(prefix=f"outlast-preempt-{variant}-")
    events = os.path.join(work, "events.jsonl")
    os.environ["OUTLAST_CAPACITY_TIMEOUT_S"] = str(args.capacity_timeout_s)
    out: dict = {"variant": variant}
    t_start = time.time()
    with head_and_workers(work, workers=2 if variant == "spare" else 1, cpus=2) as (cluster, workers):
        out["cluster_start_s"] = time.time() - t_start
        drained: dict = {}

        def drain_and_reclaim():
            while not any(e.get("ev") == "step" and e["rank"] == 0 and e["step"] >= args.drain_step
                          for e in read_events(events)):
                time.sleep(0.01)
            node = next(e["node"] for e in read_events(events) if e.get("ev") == "attempt_start")
            t0 = time.time()
            done = subprocess.run([sys.executable, "-m", "outlast.cli.main", "drain-node", "--node-id", node,
                                   "--reason", "preemption", "--reason-message", "bench",
                                   "--deadline-remaining-seconds", str(args.deadline_s)],
                                  capture_output=True, text=True, cwd=ROOT)
            drained.update(node=node, t_cli_start=t0, t=time.time(), rc=done.returncode,
                           output=(done.stdout + done.stderr).strip())
            log(f"drained {node}: {drained['output']}")
            time.sleep(max(0.0, t0 + args.deadline_s - time.time()))
            cluster.kill_node(node)  # the cloud takes the machine at the deadline
            drained["killed_t"] = time.time()
            log(f"killed {node} at the deadline")
            # What a user sees in the run's history meanwhile (`outlast runs`), and how soon.
            while time.time() < drained["killed_t"] + 30:
                try:
                    state = json.load(open(os.path.join(work, "storage", "preempt", "run_state.json")))
                except (OSError, ValueError):
                    state = {}
                if state.get("status") not in (None, "running"):
                    drained["status_after_deadline"] = {
                        "status": state["status"], "waiting_for": state.get("waiting_for"),
                        "seconds_after_the_node_went": time.time() - drained["killed_t"]}
                    break
                time.sleep(0.1)

        threading.Thread(target=drain_and_reclaim, daemon=True).start()
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"events": events, "idle_calls": args.idle_calls if variant == "spare" else 0,
                               "step_s": 0.02, "ckpt_every": 10, "steps_after_restart": 3},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1},
                                         placement_strategy="STRICT_PACK"),
            run_config=RunConfig(name="preempt", storage_path=os.path.join(work, "storage"),
                                 failure_config=FailureConfig(max_failures=0),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)))
        t_fit = time.time()
        try:
            trainer.fit()
            out["fit"] = "finished"
        except TrainingFailedError as e:
            out["fit"] = "raised " + type(e).__name__
            out["error_message"] = str(e).splitlines()[0][:400]
        out["fit_end_t_after_drain_s"] = time.time() - drained.get("t", t_fit)
        state = json.load(open(os.path.join(work, "storage", "preempt", "run_state.json")))
        out["run_state_status"] = state["status"]
        out["run_state_waiting_for"] = state.get("waiting_for")
        out["run_state_after_the_node_went"] = drained.get("status_after_deadline")
        out.update(figures(read_events(events), drained, spare_nodes=set(workers) - {drained.get("node")}))
    return out


def figures(evs: list[dict], drained: dict, spare_nodes: set[str]) -> dict:
    fig: dict = {"drained_node": drained.get("node"), "drain_cli_s": drained.get("t", 0) - drained.get("t_cli_start", 0)}
    t_drain = drained.get("t")
    if t_drain is None:
        return {**fig, "error": "the drain never happened"}
    idle = [e["per_call_s"] for e in evs if e.get("ev") == "idle_cost"]
    if idle:
        fig["get_preemption_info_idle_call_us"] = max(idle) * 1e6
    first_seen: dict[int, dict] = {}
    for e in evs:
        if e.get("ev") == "preempt_seen":
            first_seen.setdefault(e["rank"], e)
    ranks = {e["rank"] for e in evs if e.get("ev") == "attempt_start"}
    if first_seen and set(first_seen) >= ranks:
        fig["drain_to_preemption_info_all_ranks_s"] = max(e["t"] for e in first_seen.values()) - t_drain
        fig["preemption_info_same_step_on_every_rank"] = len({e["step"] for e in first_seen.values()}) == 1
    first_pids = {e["pid"] for e in evs if e.get("ev") == "attempt_start" and e["restored_from"] is None}
    before = [e for e in evs if e.get("ev") == "step" and e["pid"] in first_pids]
    if before:
        fig["last_step_before_restart"] = max(e["step"] for e in before)
    jit = [e for e in evs if e.get("ev") == "ckpt" and e.get("jit") and e["rank"] == 0]
    if jit:
        fig["jit_checkpoint_step"] = jit[0]["step"]
    on_spare = [e for e in evs if e.get("ev") == "step" and e["t"] > t_drain and e["node"] in spare_nodes]
    if on_spare:
        first = min(on_spare, key=lambda e: e["t"])
        fig["drain_to_first_step_on_spare_s"] = first["t"] - t_drain
        fig["restarted_attempt"] = {"node": first["node"], "resumed_from_step": first["restored_from"],
                                    "first_step": first["step"]}
        if before and first["restored_from"] is not None:
            fig["steps_lost"] = fig["last_step_before_restart"] - first["restored_from"]
    fig["ranks_started_after_drain"] = sum(1 for e in evs if e.get("ev") == "attempt_start" and e["t"] > t_drain)
    return fig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=["both", "spare", "nospare"], default="both")
    p.add_argument("--drain-step", type=int, default=30)
    p.add_argument("--deadline-s", type=float, default=20)
    p.add_argument("--idle-calls", type=int, default=200_000)
    p.add_argument("--capacity-timeout-s", type=float, default=30,
                   help="OUTLAST_CAPACITY_TIMEOUT_S: how long the run without a spare waits for one")
    args = p.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    variants = ["spare", "nospare"] if args.variant == "both" else [args.variant]
    results = {v: run_variant(v, args) for v in variants}
    s = results.get("spare", {})
    doc = {
        "drain_to_preemption_info_all_ranks_s": s.get("drain_to_preemption_info_all_ranks_s"),
        "get_preemption_info_idle_call_us": s.get("get_preemption_info_idle_call_us"),
        "drain_to_first_step_on_spare_s": s.get("drain_to_first_step_on_spare_s"),
        "steps_lost": s.get("steps_lost"),
        "no_spare": {k: results.get("nospare", {}).get(k) for k in (
            "run_state_after_the_node_went", "run_state_status", "fit", "error_message", "fit_end_t_after_drain_s")},
        "spare": s,
        "nospare": results.get("nospare"),
    }
    print(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
