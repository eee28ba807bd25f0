"""Exactness of a run's data through kills and a resize: how often each row is used in each epoch, and
whether the model ends as a run without faults ends; and, on Ray 2.60 in the same run, the rows the same loop
reads again through kills.

    python3 -m bench.data_exactness [--parts outlast ray] [--kills 100] [--ray-kills 8] [--epochs 3] [--rows 600]
        [--out bench/results/data-exactness.json]

The outlast part: three runs of one loop (bench/lib/exact_loop.py), each on a fresh local cluster of 3 nodes of
1 CPU: a TorchTrainer of 2 to 4 workers (elastic) reads an outlast.data parquet dataset (`--rows` rows in row
groups of 7, none on a rank's boundary) through `get_dataset_shard("train").iter_torch_batches(batch_size=2)`,
trains a small float64 model on it and reports a checkpoint (the model and the optimizer) every step. The
first run has no faults. In the second, rank 1 kills itself (SIGKILL) in each of the first `--kills`
attempts, at steps spread over the epochs, at 3 ranks throughout. The third has the same kills, then a node
is killed (3 -> 2 workers) and, once the 2 train, a node is added (2 -> 3); once the 3 train, a node is drained
with nowhere to move (3 -> 2) and, once the 2 train, another added (2 -> 3).

A step counts when it is no later than the step the next attempt restored (later steps were taken again).
Figures, per epoch: how many rows were used 0, 1 or more times (outlast: all once), and what the same
faults would cost a loop on Ray, whose Ray Data restarts an epoch at its start: the rows of the epoch used
before each restored step, used again. That figure is derived from the run's restore points: a worker
SIGKILL takes Ray 2.60 tens of seconds to train again on this machine, so 100 of them would take over an
hour. The final weights of the two runs with faults, each float in hex, against the run without: they must be
the same bits. Across the resize that needs `--virtual-ranks` (6 by default): the dataset is split into that
many fixed shares, a step reads a batch of each (6 rows at any world size) and `virtual_rank_gradients` sums
their gradients in one order; with `--virtual-ranks 0` each rank reads batches of 2 and the gradients are
all-reduced, so the steps at 2 ranks average 4 rows, not 6, and the resized run ends with other weights.

The ray part measures it: the same loop written for Ray 2.60 (bench/lib/ray_exact_loop.py, run by
bench/.ray-venv's python: a TorchTrainer of 3 workers on `ray.data.from_items` of the same rows, the epoch and
the step restored from `ray.train.get_checkpoint()`, FailureConfig(max_failures) restarting the group) and
outlast's loop at 3 ranks, each through the same `--ray-kills` kills of rank 1. For each side: the rows used
again per epoch, counted from the rows each step logged, beside the figure derived from that side's restore
points as above, and the seconds from each kill to the next attempt's first step.
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
from collections import Counter

from bench.lib import harness, reread, venvs
from bench.lib.events import read_events

ROW_GROUP = 7
BATCH = 2
RUN_VAR = "OUTLAST_BENCH_EXACT_RUN"  # carried by every process of a Ray run: what is killed at its end


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} in {timeout} s")
        time.sleep(0.2)


def counted_uses(events: list[dict]) -> tuple[dict[int, Counter], dict[int, int]]:
    """(epoch -> row -> uses in steps that counted, epoch -> rows Ray would have used again). Each restore puts
    the run at the step it restored; on Ray the loop would read that step's epoch again from its start."""
    restored = reread.restored_steps(events)
    counted = reread.counted(events)
    uses = reread.uses_by_epoch(events)
    ray_again: Counter = Counter()
    last = {}
    for e in counted:
        last[e["epoch"]] = max(last.get(e["epoch"], -1), e["step"])
    for attempt, step in restored.items():
        if step is None or attempt == 1:
            continue
        epoch = next(e["epoch"] for e in counted if e["step"] == step)
        if step < last[epoch]:  # restored mid-epoch: on Ray, the epoch's rows up to it are read again
            ray_again[epoch] += sum(len(e["rows"]) for e in counted if e["epoch"] == epoch and e["step"] <= step)
    return uses, dict(ray_again)


def position_cost(storage: str) -> dict:
    """The data positions the run's checkpoints keep: the largest rank's document in bytes, and what encoding
    that document again (`data_position.encode`, done at every report) takes, in microseconds."""
    import glob
    import json
    import timeit

    from outlast.train import data_position as dp

    docs = []
    for manifest in glob.glob(os.path.join(storage, "*", "*", ".outlast-manifest.json")):
        with open(manifest) as f:
            docs += [text for text in (json.load(f).get("data_positions") or {}).values() if text]
    if not docs:
        return {}
    largest = max(docs, key=len)
    head = json.loads(largest)
    positions = dp.decode(largest, "the largest document")
    n = 2000
    took = timeit.timeit(lambda: dp.encode(head["world"], head["rank"], positions), number=n) / n
    return {"documents": len(docs), "largest_bytes": len(largest),
            "median_bytes": sorted(len(d) for d in docs)[len(docs) // 2], "encode_us": round(took * 1e6, 1)}


def train(args: argparse.Namespace, workdir: str, kills: dict[str, int], resize: bool) -> tuple[list[dict], float, str | None]:
    """One run of `exact_loop` on a fresh local cluster of 3 nodes: rank 1 killed at the steps `kills` names,
    and with `resize` a node killed and, once the 2 left train, one added. Its events, seconds and error."""
    from bench.lib.exact_loop import exact_loop
    from outlast import data
    from outlast.testing import LocalCluster
    from outlast.train import DataConfig, FailureConfig, RunConfig, ScalingConfig
    from outlast.train.torch import TorchTrainer

    events = os.path.join(workdir, "events.jsonl")
    with LocalCluster(num_nodes=3, cpus_per_node=1, node_timeout_s=2, workdir=os.path.join(workdir, "cl")) as cl:
        def resize_now() -> None:
            def attempt_at(a: int, s: int) -> bool:
                return any(e["event"] == "used" and e["attempt"] == a and e["step"] >= s
                           for e in read_events(events))
            def attempt_after(a: int) -> bool:
                return any(e["event"] == "used" and e["attempt"] > a for e in read_events(events))

            def attempts() -> int:
                return max((e["attempt"] for e in read_events(events) if e["event"] == "start"), default=0)

            after = len(kills) + 1
            last_kill = max(kills.values(), default=0)
            wait_for(lambda: attempt_at(after, last_kill + 2), 900, f"attempt {after} past the last kill")
            cl.kill_node("node-2")
            wait_for(lambda: attempt_after(after), 300, "training at 2 workers")
            grown = attempts()
            cl.add_node("node-3")
            wait_for(lambda: attempt_after(grown), 300, "training at 3 workers again")
            # A drain with nowhere to move: the elastic run goes on at 2, then grows on a node added once it does.
            drained = attempts()
            cl.drain_node("node-1", deadline_s=10)
            wait_for(lambda: attempt_after(drained), 300, "training at 2 workers after the drain")
            grown = attempts()
            cl.add_node("node-4")
            wait_for(lambda: attempt_after(grown), 300, "training at 3 workers after the drain")

        t = threading.Thread(target=resize_now, daemon=True)
        if resize:
            t.start()
        started = time.time()
        result = TorchTrainer(
            exact_loop, datasets={"train": data.read_parquet(os.path.join(os.path.dirname(workdir), "rows.parquet"))},
            train_loop_config={"events": events, "epochs": args.epochs, "kills": kills, "step_sleep": args.step_sleep,
                               # the resizes come after the kills: steps long enough for the four to fit in the run
                               "slow_from": max(kills.values(), default=0) + 1 if resize else None,
                               "slow_step_sleep": args.resize_step_sleep,
                               # a virtual rank's batch: the step's 3 * BATCH rows among them
                               "batch": 3 * BATCH // args.virtual_ranks if args.virtual_ranks else BATCH,
                               "virtual_ranks": args.virtual_ranks},
            dataset_config=DataConfig(virtual_ranks=args.virtual_ranks or None),
            scaling_config=ScalingConfig(num_workers=(2, 4), resources_per_worker={"CPU": 1},
                                         elastic_resize_monitor_interval_s=0),
            run_config=RunConfig(name="exact", storage_path=os.path.join(workdir, "storage"),
                                 failure_config=FailureConfig(max_failures=len(kills) + 2))).fit()
        took = time.time() - started
        if resize:
            t.join(timeout=5)
    return read_events(events), took, getattr(result, "error", None) and str(result.error)


def final_weights(events: list[dict]) -> dict[str, list[str]]:
    (last,) = [e for e in events if e["event"] == "weights"]
    return last["weights"]


def weights_compared(weights: dict[str, list[str]], reference: dict[str, list[str]]) -> dict:
    """Bit for bit (each float's hex), and the largest absolute difference."""
    pairs = [(float.fromhex(a), float.fromhex(b)) for k in reference for a, b in zip(weights[k], reference[k])]
    return {"bit_identical": weights == reference, "max_abs_difference": max(abs(a - b) for a, b in pairs)}


def exactness(events: list[dict], args: argparse.Namespace, took: float, error: str | None) -> dict:
    uses, ray_again = counted_uses(events)
    worlds = [e["world"] for e in events if e["event"] == "start" and e["rank"] == 0]
    per_epoch = {}
    for epoch in range(args.epochs):
        counts = uses.get(epoch, Counter())
        histogram = Counter(counts[r] for r in range(args.rows // 3 * 3))
        per_epoch[str(epoch)] = {"rows_used": dict(sorted((str(k), v) for k, v in histogram.items())),
                                 "ray_rows_used_again": ray_again.get(epoch, 0)}
    return {"attempts": len(worlds), "worlds": worlds, "kills": len([e for e in events if e["event"] == "kill"]),
            "restores": sum(1 for e in events if e["event"] == "start" and e["rank"] == 0
                            and e["restored_step"] is not None),
            "per_epoch": per_epoch,
            "every_row_once_each_epoch": all(set(v["rows_used"]) == {"1"} for v in per_epoch.values()),
            "ray_rows_used_again_total": sum(ray_again.values()), "error": error, "took_s": round(took, 1)}


def kill_plan(total: int, kills: int) -> dict[str, int]:
    """Attempt -> the step rank 1 kills itself at: the k-th kill spread over the run's first two thirds, off the
    epochs' boundaries."""
    return {str(a + 1): int((a + 1) * total * 2 / 3 / (kills + 1)) + 1 for a in range(kills)}


def run(args: argparse.Namespace, workdir: str) -> dict:
    """Three runs of the same loop on the same rows: without faults, with the kills alone (3 ranks
    throughout) and with the kills and the resize."""
    total = args.rows // 3 // BATCH * args.epochs
    kills = kill_plan(total, args.kills)
    log(f"{args.rows} rows, {total // args.epochs} steps an epoch at 3 ranks, kills at {kills}")
    runs = {}
    for name, run_kills, resize in (("no_faults", {}, False), ("kills", kills, False),
                                    ("kills_and_resize", kills, True)):
        os.makedirs(os.path.join(workdir, name))
        log(f"run {name}")
        runs[name] = train(args, os.path.join(workdir, name), run_kills, resize)
    reference = final_weights(runs["no_faults"][0])
    figures = {}
    for name in ("kills_and_resize", "kills"):
        events, took, error = runs[name]
        figures[name] = {**exactness(events, args, took, error),
                         "final_weights_against_no_faults": weights_compared(final_weights(events), reference)}
    figures["no_faults"] = {"took_s": round(runs["no_faults"][1], 1), "error": runs["no_faults"][2]}
    figures["position_saved_with_each_checkpoint"] = position_cost(
        os.path.join(workdir, "kills_and_resize", "storage"))
    return figures


def train_on_ray(args: argparse.Namespace, workdir: str, kills: dict[str, int]) -> tuple[list[dict], str | None]:
    """One run of bench/lib/ray_exact_loop.py in Ray's virtual environment, rank 1 killed at the steps `kills`
    names. Its events and error; every process it started is killed at the end."""
    from bench.lib import proctree

    events, log_path, run_id = (os.path.join(workdir, "events.jsonl"), os.path.join(workdir, "ray.log"),
                                os.path.basename(workdir))
    cmd = venvs.module(venvs.RAY_PY, "bench.lib.ray_exact_loop", "--events", events,
                       "--storage", os.path.join(workdir, "storage"), "--kills", json.dumps(kills),
                       "--rows", str(args.rows), "--epochs", str(args.epochs), "--batch", str(BATCH))
    # Ray's report() waits for the controller to take the previous result, which it does once a poll (2 s by
    # default): at the default a step would take 2 s, so the controller polls as often as a step takes.
    env = venvs.with_root({**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_V2_ENABLED": "1",
                           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(args.ray_poll_s), RUN_VAR: run_id})
    since = time.time()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=venvs.ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.ray_timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            proctree.killpg(proc.pid)
            proc.wait()
    proctree.kill_all(proctree.ours(RUN_VAR, run_id, (), since))
    got = read_events(events)
    ends = [e for e in got if e["event"] == "fit_end"]
    error = None if rc == 0 and ends and ends[0]["error"] is None else (
        f"rc {rc}, {ends[0]['error'] if ends else 'no result'}; see {log_path}")
    return got, error


def ray_part(args: argparse.Namespace, workdir: str) -> dict:
    """The same loop written for Ray 2.60 and for outlast, each through the same `--ray-kills` kills at 3 ranks:
    the rows each used again per epoch, measured, beside the figure derived from the restore points."""
    steps_per_epoch = args.rows // 3 // BATCH
    kills = kill_plan(steps_per_epoch * args.epochs, args.ray_kills)
    load_before = harness.load()
    log(f"ray part: kills at {kills}")
    sides: dict[str, dict] = {}
    for side in ("outlast", "ray"):
        side_dir = os.path.join(workdir, f"{side}_kills")
        os.makedirs(side_dir)
        load = harness.load()
        started = time.time()
        if side == "outlast":
            events, _, error = train(args, side_dir, kills, False)
        else:
            events, error = train_on_ray(args, side_dir, kills)
        took = time.time() - started
        log(f"{side}: {took:.0f} s, error {error}")
        uses = reread.uses_by_epoch(events)
        again = reread.used_again(uses)
        restores = [s for a, s in sorted(reread.restored_steps(events).items()) if a > 1 and s is not None]
        derived = reread.derived_again(restores, steps_per_epoch, 3 * BATCH)
        per_epoch = {}
        for epoch in range(args.epochs):
            counts = uses.get(epoch, Counter())
            histogram = Counter(counts[r] for r in range(steps_per_epoch * 3 * BATCH))
            per_epoch[str(epoch)] = {"rows_used": dict(sorted((str(k), v) for k, v in histogram.items())),
                                     "rows_used_again": again.get(epoch, 0),
                                     "derived_rows_used_again": derived.get(epoch, 0)}
        restarts = reread.restart_seconds(events)
        sides[side] = {
            "kills": len([e for e in events if e["event"] == "kill"]), "restored_steps": restores,
            "steps_taken": len({(e["attempt"], e["step"]) for e in events if e["event"] == "used"}),
            "steps_counted": len({e["step"] for e in reread.counted(events)}),
            "per_epoch": per_epoch, "rows_used_again_total": sum(again.values()),
            "derived_rows_used_again_total": sum(derived.values()),
            "restart_s": harness.summary(restarts), "restarts_s": restarts,
            "took_s": round(took, 1), "load1_at_start": load[0], "error": error}
    ray, outlast, rows = sides["ray"], sides["outlast"], args.epochs * steps_per_epoch * 3 * BATCH
    ray["rows_used_again_per_kill"] = round(ray["rows_used_again_total"] / max(ray["kills"], 1), 1)
    ratios = {"ray_measured_over_derived": harness.ratio(ray["rows_used_again_total"],
                                                         ray["derived_rows_used_again_total"]),
              "ray_used_again_over_the_epochs_rows": ray["rows_used_again_total"] / rows,
              "ray_steps_taken_over_outlast": harness.ratio(ray["steps_taken"], outlast["steps_taken"]),
              "ray_restart_over_outlast": harness.ratio(ray["restart_s"], outlast["restart_s"])}
    return {"kill_steps": kills, **sides, "ratios": {k: v if v is None else round(v, 3) for k, v in ratios.items()},
            "ray_settings": {"workers": 3, "dataset": f"ray.data.from_items of {args.rows} rows",
                             "through": f"get_dataset_shard('train').iter_torch_batches(batch_size={BATCH}), "
                                        "a new pass each epoch",
                             "checkpoint": "rank 0's every step (CheckpointConfig(num_to_keep=2))",
                             "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": args.ray_poll_s},
            "date": harness.stamp(), "load": {"before": load_before, "after": harness.load(),
                                              "note": "load1_at_start: the 1-minute load average when each side began"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["outlast", "ray"], choices=["outlast", "ray"])
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--ray-kills", type=int, default=8, help="the kills of the ray part, on each side")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rows", type=int, default=600)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--resize-step-sleep", type=float, default=0.3,
                   help="seconds each step sleeps in the resized run once its kills are over")
    p.add_argument("--virtual-ranks", type=int, default=6, choices=[0, 6],
                   help="DataConfig(virtual_ranks=...) of the outlast runs (0: none); each step reads 6 rows among them")
    p.add_argument("--ray-poll-s", type=float, default=0.1, help="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S of the Ray run")
    p.add_argument("--ray-timeout", type=int, default=3600, help="seconds the Ray run may take")
    p.add_argument("--out", help="also write the JSON document here (bench/results/data-exactness.json)")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="outlast-bench-exact-")
    harness.private_state_dirs(workdir)
    load_before = harness.load()
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.environ["OUTLAST_NODE_TIMEOUT_S"] = "2"
    pq.write_table(pa.table({"i": np.arange(args.rows)}), os.path.join(workdir, "rows.parquet"),
                   row_group_size=ROW_GROUP)
    figures = run(args, workdir) if "outlast" in args.parts else {}
    versions = {}
    if "ray" in args.parts:
        venvs.ensure_ray_venv()
        figures["ray_kills"] = ray_part(args, workdir)
        versions = {"ray": subprocess.run([venvs.RAY_PY, "-c", "import ray; print(ray.__version__)"],
                                          capture_output=True, text=True).stdout.strip()}
    doc = {"benchmark": "data-exactness", "date": harness.stamp(), "figures": figures,
           "settings": {"kills": args.kills, "ray_kills": args.ray_kills, "epochs": args.epochs, "rows": args.rows,
                        "batch_size": BATCH, "row_group": ROW_GROUP, "parts": args.parts,
                        "virtual_ranks": args.virtual_ranks,
                        "resize": "3 -> 2 -> 3 (a node killed, then one added) -> 2 -> 3 (a node drained with "
                                  "nowhere to move, then one added)"},
           "ray": "kills, kills_and_resize: derived: the rows of each restored step's epoch used up to that step, "
                  "which a loop on Ray reads again (Ray Data restarts an epoch at its start); ray_kills: measured "
                  "on Ray 2.60 with the same loop, beside the figure derived from its restore points",
           "machine": harness.machine(versions), "load": {"before": load_before, "after": harness.load()}}
    harness.publish(doc, args.out)


if __name__ == "__main__":
    main()
