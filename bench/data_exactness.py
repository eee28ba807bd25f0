"""Exactness of a run's data through kills and a resize: how often each row is used in each epoch, and
whether the model ends as a run without faults ends.

    python3 -m bench.data_exactness [--kills 100] [--epochs 3] [--rows 600] [--out bench/results/data-exactness.json]

Three runs of one loop (bench/lib/exact_loop.py), each on a fresh local cluster of 3 nodes of 1 CPU: a
TorchTrainer of 2 to 4 workers (elastic) reads an outlast.data parquet dataset (`--rows` rows in row groups
of 7, none on a rank's boundary) through `get_dataset_shard("train").iter_torch_batches(batch_size=2)`,
trains a small float64 model on it and reports a checkpoint (the model and the optimizer) every step. The
first run has no faults. In the second, rank 1 kills itself (SIGKILL) in each of the first `--kills`
attempts, at steps spread over the epochs, at 3 ranks throughout. The third has the same kills, then a node
is killed (3 -> 2 workers) and, once the 2 train, a node is added (2 -> 3).

A step counts when it is no later than the step the next attempt restored (later steps were taken again).
Figures, per epoch: how many rows were used 0, 1 or more times (outlast: all once), and what the same
faults cost a loop on Ray, whose Ray Data restarts an epoch at its start: the rows of the epoch used before
each restored step, used again. Ray's figure is derived from this run's restore points, not measured on
Ray: a worker SIGKILL takes Ray 2.60 about a minute to train again on this machine (61.4 s, the median
of bench/results/core_kill.json), so 100 of them would take well over an hour. The final weights of the
two runs with faults, each float in hex, against the run without: with the kills alone they must be the
same bits; across the resize they cannot be, since the steps at 2 ranks average the gradients of 4 rows,
not 6, and the rows are split again.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections import Counter

from bench.lib import harness
from bench.lib.events import read_events

ROW_GROUP = 7
BATCH = 2


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
    restored = {e["attempt"]: e["restored_step"] for e in events if e["event"] == "start"}
    counted = [e for e in events if e["event"] == "used" and not (
        restored.get(e["attempt"] + 1, "never") is None or
        (restored.get(e["attempt"] + 1, "never") != "never" and e["step"] > restored[e["attempt"] + 1]))]
    uses: dict[int, Counter] = {}
    for e in counted:
        uses.setdefault(e["epoch"], Counter()).update(e["rows"])
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
    from outlast.train import FailureConfig, RunConfig, ScalingConfig
    from outlast.train.torch import TorchTrainer

    events = os.path.join(workdir, "events.jsonl")
    total = args.rows // 3 // BATCH * args.epochs
    with LocalCluster(num_nodes=3, cpus_per_node=1, node_timeout_s=2, workdir=os.path.join(workdir, "cl")) as cl:
        def resize_now() -> None:
            def attempt_at(a: int, s: int) -> bool:
                return any(e["event"] == "used" and e["attempt"] == a and e["step"] >= s
                           for e in read_events(events))
            after = len(kills) + 1
            wait_for(lambda: attempt_at(after, int(total * 0.7)), 900, f"attempt {after} at 70% of the run")
            cl.kill_node("node-2")
            wait_for(lambda: any(e["event"] == "used" and e["attempt"] > after for e in read_events(events)), 300,
                     "training at 2 workers")
            cl.add_node("node-3")

        t = threading.Thread(target=resize_now, daemon=True)
        if resize:
            t.start()
        started = time.time()
        result = TorchTrainer(
            exact_loop, datasets={"train": data.read_parquet(os.path.join(os.path.dirname(workdir), "rows.parquet"))},
            train_loop_config={"events": events, "epochs": args.epochs, "batch": BATCH, "kills": kills,
                               "step_sleep": args.step_sleep},
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


def run(args: argparse.Namespace, workdir: str) -> dict:
    """Three runs of the same loop on the same rows: without faults, with the kills alone (3 ranks
    throughout) and with the kills and the resize."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.environ["OUTLAST_NODE_TIMEOUT_S"] = "2"
    pq.write_table(pa.table({"i": np.arange(args.rows)}), os.path.join(workdir, "rows.parquet"),
                   row_group_size=ROW_GROUP)
    total = args.rows // 3 // BATCH * args.epochs
    # The k-th kill at a step spread over the run's first two thirds, off the epochs' boundaries.
    kills = {str(a + 1): int((a + 1) * total * 2 / 3 / (args.kills + 1)) + 1 for a in range(args.kills)}
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rows", type=int, default=600)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--out", help="also write the JSON document here (bench/results/data-exactness.json)")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="outlast-bench-exact-")
    harness.private_state_dirs(workdir)
    load_before = harness.load()
    figures = run(args, workdir)
    doc = {"benchmark": "data-exactness", "date": harness.stamp(), "figures": figures,
           "settings": {"kills": args.kills, "epochs": args.epochs, "rows": args.rows, "batch_size": BATCH,
                        "row_group": ROW_GROUP, "resize": "3 -> 2 -> 3 (a node killed, then one added)"},
           "ray": "derived: the rows of each restored step's epoch used up to that step, which a loop on Ray "
                  "reads again (Ray Data restarts an epoch at its start); not measured on Ray",
           "machine": harness.machine({}), "load": {"before": load_before, "after": harness.load()}}
    harness.publish(doc, args.out)


if __name__ == "__main__":
    main()
