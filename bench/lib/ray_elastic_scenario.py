"""Ray 2.60 side of the elastic benchmark: a node lost with no spare, then a node added.

    bench/.ray-venv/bin/python -m bench.lib.ray_elastic_scenario [--repeats 1] [--lose-step 10]
        [--interval-s 60] [--budget-s 240]

The same scenario as bench/lib/elastic_scenario.py on `ray.cluster_utils.Cluster`: a head with
0 CPUs (the driver and the Train controller) and two 1-CPU worker nodes; a TorchTrainer
(gloo) with ScalingConfig(num_workers=(1, 2), elastic_resize_monitor_interval_s=N), one CPU
per worker, FailureConfig(max_failures=-1); the loop sleeps ~20 ms, all-reduces one number,
calls get_preemption_info(), reports every step, checkpoints every 10 steps and on the
first notice.

  lost:  at --lose-step, the node of rank 1 is removed without grace (a lost machine):
         kill -> first step at world size 1, and steps lost.
  added: --settle-steps later, a 1-CPU node is added: add -> first step at world size 2, and
         steps lost; bounded by --budget-s (then "not within the budget").

Each repeat runs in its own session; every process in it is killed at the end. One JSON
document on stdout, progress on stderr.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.lib import step_checkpoint
from bench.lib.elastic_loop import train_steps
from bench.lib.events import emit, read_events
from bench.lib.harness import load, summarize_runs
from bench.lib.ray_preemption_scenario import DriverLog, ray_env, stop_driver, sweep
from bench.lib.venvs import ROOT, module


def log(msg):
    print(f"[ray-elastic {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def train_loop_per_worker(config):
    import ray
    from ray import train

    events = config["events"]
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    node = ray.get_runtime_context().get_node_id()
    restored_from = step_checkpoint.restored_step(train)
    start = 0 if restored_from is None else restored_from + 1
    emit(events, ev="attempt_start", rank=rank, world=world, node=node, restored_from=restored_from,
         t=time.time())
    train_steps(train, events, range(start, 10**9), config["step_s"], rank, world=world, node=node)


def run_driver(args):
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=args.address, log_to_driver=True)
    TorchTrainer(
        train_loop_per_worker, train_loop_config={"events": args.events, "step_s": 0.02},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=(1, 2), use_gpu=False, resources_per_worker={"CPU": 1},
                                     elastic_resize_monitor_interval_s=args.interval_s),
        run_config=RunConfig(name="elastic", storage_path=args.storage,
                             failure_config=FailureConfig(max_failures=-1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    ).fit()
    return 0


def wait_events(events, pred, until, proc, driver_log):
    while time.time() < until:
        driver_log.poll()
        evs = read_events(events)
        if pred(evs):
            return evs
        if proc.poll() is not None:
            raise RuntimeError(f"the driver exited (rc={proc.returncode})")
        time.sleep(0.05)
    return None


def run_once(args):
    from ray.cluster_utils import Cluster

    until = args.until - 15
    work = tempfile.mkdtemp(prefix="ray-elastic-")
    events = os.path.join(work, "events.jsonl")
    driver_log = DriverLog(os.path.join(work, "driver.log"))
    out, marks, proc, cluster = {}, {}, None, None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        cmd = module(sys.executable, __spec__.name, "--_driver", "--address", cluster.address, "--events", events,
                     "--storage", os.path.join(work, "storage"), "--interval-s", str(args.interval_s))
        with open(driver_log.path, "w") as f:
            proc = subprocess.Popen(cmd, env=ray_env(), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                    process_group=0)
        evs = wait_events(events, lambda evs: any(e["ev"] == "step" and e["world"] == 2 and e["step"] >= args.lose_step
                                                  for e in evs), until, proc, driver_log)
        if evs is None:
            raise TimeoutError("the run never trained at world size 2")
        victim = next(e["node"] for e in evs if e["ev"] == "attempt_start" and e["rank"] == 1)
        marks["last_step_before_kill"] = max(e["step"] for e in evs if e["ev"] == "step")
        marks["kill_t"] = time.time()
        cluster.remove_node(next(n for n in nodes if n.node_id == victim), allow_graceful=False)
        log(f"removed {victim[:8]}")
        evs = wait_events(events, lambda evs: sum(e["ev"] == "step" and e["world"] == 1 for e in evs) >= args.settle_steps,
                          until, proc, driver_log)
        if evs is None:
            out["lost"] = "not training at world size 1 within the budget"
            return out
        out["lost_to_training_at_smaller_size_s"] = min(
            e["t"] for e in evs if e["ev"] == "step" and e["world"] == 1) - marks["kill_t"]
        restored = next((e["restored_from"] for e in evs if e["ev"] == "attempt_start" and e["world"] == 1), None)
        out["lost_steps_lost"] = marks["last_step_before_kill"] - (restored if restored is not None else -1)
        marks["add_t"] = time.time()
        cluster.add_node(num_cpus=1)
        log("added a node")
        grown = wait_events(events, lambda evs: any(e["ev"] == "step" and e["world"] == 2 and e["t"] > marks["add_t"]
                                                    for e in evs), until, proc, driver_log)
        if grown is None:
            out["added"] = f"not training at world size 2 within {until - marks['add_t']:.0f} s of the add"
            return out
        out["added_to_training_at_larger_size_s"] = min(
            e["t"] for e in grown if e["ev"] == "step" and e["world"] == 2 and e["t"] > marks["add_t"]) - marks["add_t"]
        before = max(e["step"] for e in grown if e["ev"] == "step" and e["world"] == 1)
        again = [e["restored_from"] for e in grown if e["ev"] == "attempt_start" and e["world"] == 2
                 and e["t"] > marks["add_t"]]
        out["added_steps_lost"] = before - again[0] if again and again[0] is not None else None
        return out
    except Exception as e:  # noqa: BLE001 - report what we have
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        if proc is not None:
            stop_driver(proc, grace=3)
        if cluster is not None:
            try:
                cluster.shutdown()
            except Exception as e:  # noqa: BLE001
                out["shutdown_error"] = repr(e)
        with open(args.out, "w") as f:
            json.dump(out, f)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--lose-step", type=int, default=10)
    p.add_argument("--interval-s", type=float, default=60.0)
    p.add_argument("--settle-steps", type=int, default=5, help="steps at world size 1 before the node is added")
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--_driver", action="store_true")
    p.add_argument("--_once", action="store_true")
    p.add_argument("--address")
    p.add_argument("--events")
    p.add_argument("--storage")
    p.add_argument("--out")
    p.add_argument("--until", type=float)
    args = p.parse_args()
    if args._driver:
        return run_driver(args)
    if args._once:
        return run_once(args) and 0
    runs = []
    for i in range(args.repeats):
        fd, result = tempfile.mkstemp(prefix="ray-elastic-", suffix=".json")
        os.close(fd)
        cmd = module(sys.executable, __spec__.name, "--_once", "--out", result, "--until",
                     str(time.time() + args.budget_s), "--lose-step", str(args.lose_step),
                     "--interval-s", str(args.interval_s), "--settle-steps", str(args.settle_steps))
        log(f"repeat {i + 1} of {args.repeats}")
        child = subprocess.Popen(cmd, env=ray_env(), cwd=ROOT, start_new_session=True)
        try:
            child.wait(timeout=args.budget_s + 60)
        except subprocess.TimeoutExpired:
            pass
        swept = sweep(child.pid)
        child.wait()
        try:
            with open(result) as f:
                runs.append(dict(json.load(f), processes_swept=swept))
        except (OSError, ValueError):
            runs.append({"error": "no result", "processes_swept": swept})
    numeric = [{k: v for k, v in r.items() if isinstance(v, (int, float)) and k != "processes_swept"} for r in runs]
    print(json.dumps({"framework": "ray 2.60", "interval_s": args.interval_s, "load_before_after": load(),
                      "runs": runs, "figures": summarize_runs(numeric)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
