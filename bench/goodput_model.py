"""The fleet model against real runs: each run's goodput, and the model's replay of the same run, part by part.

    python -m bench.goodput_model [--only kill,hang,...] [--out bench/results/goodput-model.json]

Runs small real runs on this machine: a killed rank, a hang, a drain and a lost node (the runs of
tests/integration/test_goodput.py, longer), the chaos test's run (tests/integration/test_chaos.py: six faults of
every kind in one DDP run) and the demo (examples/ddp_demo.py, a rank killed mid-run). Each is checked with
`outlast.sim.model_check.check`, the command `python -m outlast.sim check-model RUN_DIR`. Prints one JSON document:
per run, the real goodput, the model's, the difference in points of the time held, and the part that differs most.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from outlast.sim.model_check import check
from outlast.storage import open_storage
from outlast.storage.run_store import RunStore
from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.jobs import counting_loop, preemptible_loop, read_events
from tests.integration.procs import wait_until

ROOT = Path(__file__).resolve().parents[1]
NODE_TIMEOUT_S = 2.0


def global_batch_loop(config: dict) -> None:
    """counting_loop with the same global batch at any size: a step's work (`work_s`, rank-seconds) is shared by the
    ranks, so on fewer ranks each step takes longer, as the fleet model assumes of an elastic run."""
    from outlast import train

    counting_loop({**config, "step_sleep": config["work_s"] / train.get_context().get_world_size()})


def _fit(loop: Callable[[dict], None], storage: str, config: dict, workers: Any = 2, **failure: Any) -> None:
    Trainer(loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=workers),
            run_config=RunConfig(name="run", storage_path=storage, failure_config=FailureConfig(**failure))).fit()


def kill(storage: str) -> str:
    fault = {"rank": 1, "step": 57, "when": "before_report", "kind": "kill"}
    _fit(counting_loop, storage, {"events": f"{storage}/e.jsonl", "steps": 120, "every": 10, "step_sleep": 0.05,
                                  "fault": fault}, max_failures=1)
    return "run"


def hang(storage: str) -> str:
    fault = {"rank": 1, "step": 45, "when": "before_report", "kind": "hold"}
    _fit(counting_loop, storage, {"events": f"{storage}/e.jsonl", "steps": 80, "every": 10, "step_sleep": 0.05,
                                  "fault": fault}, max_failures=1, hang_timeout_s=3)
    return "run"


def drain(storage: str) -> str:
    events = Path(storage) / "e.jsonl"
    with LocalCluster(num_nodes=2, cpus_per_node=1) as cluster:
        def notice() -> None:
            wait_until(lambda: any(e.get("step", -1) >= 40 for e in read_events(events)), 120, "step 40")
            (start,) = [e for e in read_events(events) if e["event"] == "start"]
            cluster.drain_node(start["node_id"], deadline_s=10)

        t = threading.Thread(target=notice, daemon=True)
        t.start()
        Trainer(preemptible_loop, train_loop_config={"events": str(events), "steps": 100, "step_sleep": 0.05,
                                                     "every": 10},
                scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
                run_config=RunConfig(name="run", storage_path=storage)).fit()
        t.join()
    return "run"


def lost_node(storage: str) -> str:
    os.environ["OUTLAST_NODE_TIMEOUT_S"] = str(NODE_TIMEOUT_S)
    events = Path(storage) / "e.jsonl"
    with LocalCluster(num_nodes=2, cpus_per_node=1, node_timeout_s=NODE_TIMEOUT_S) as cluster:
        def lose() -> None:
            # Mid-way between two checkpoints (every 10 steps), as the kill and the hang are.
            wait_until(lambda: any(e.get("step", -1) >= 44 for e in read_events(events)), 120, "step 44")
            cluster.kill_node("node-1")

        t = threading.Thread(target=lose, daemon=True)
        t.start()
        Trainer(global_batch_loop, train_loop_config={"events": str(events), "steps": 100, "every": 10,
                                                      "work_s": 0.1},
                scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1},
                                             elastic_resize_monitor_interval_s=0),
                run_config=RunConfig(name="run", storage_path=storage,
                                     failure_config=FailureConfig(max_failures=0))).fit()
        t.join()
    return "run"


def chaos(storage: str) -> str:
    from outlast.train.torch import TorchTrainer
    from tests.integration.jobs import deterministic_ddp_loop

    # The faults test_chaos.py draws (its seed, 20261129): six attempts, each failing by a kill, a raise, a fork
    # server's or an agent's SIGKILL a few steps after its start.
    import random
    rng = random.Random(20261129)
    faults = [[attempt, rng.randrange(2), rng.randrange(1, 7), rng.choice(["kill", "raise", "forkserver", "agent"])]
              for attempt in range(1, 7)]
    TorchTrainer(deterministic_ddp_loop,
                 train_loop_config={"events": f"{storage}/e.jsonl", "steps": 40, "every": 3, "faults": faults},
                 scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name="chaos", storage_path=storage,
                                      failure_config=FailureConfig(max_failures=-1))).fit()
    return "chaos"


def demo(storage: str) -> str:
    subprocess.run([sys.executable, str(ROOT / "examples" / "ddp_demo.py"), "--storage-path", storage,
                    "--steps", "300", "--kill-step", "120"], cwd=ROOT, check=True, capture_output=True, timeout=600)
    return "ddp_demo"


RUNS: dict[str, Callable[[str], str]] = {"kill": kill, "hang": hang, "drain": drain, "lost_node": lost_node,
                                         "chaos": chaos, "demo": demo}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    p.add_argument("--out")
    p.add_argument("--keep", help="keep each run's storage under this directory (default: removed)")
    args = p.parse_args()
    out: dict[str, Any] = {"load_average_before": list(os.getloadavg()), "cpus": os.cpu_count(), "runs": {}}
    for name in args.only.split(","):
        run = RUNS[name]
        with tempfile.TemporaryDirectory(prefix=f"goodput_model_{name}_", dir=args.keep) as storage:
            began = time.time()
            run_name = run(storage)
            store = RunStore(open_storage(storage), run_name)
            state = store.load_state()
            assert state is not None
            result = check(state, {a.attempt: store.read_reports(a.attempt) for a in state.attempts})
            result["wall_s"] = round(time.time() - began, 1)
            result["load_average_after"] = list(os.getloadavg())
            out["runs"][name] = result
            if args.keep:
                os.rename(storage, Path(args.keep) / name)
                os.makedirs(storage)  # for the context's own removal
            print(f"{name}: real {100 * result['real']['fraction']:.2f}%, model {100 * result['model']['fraction']:.2f}%"
                  f", difference {100 * result['goodput_difference']:+.2f} points "
                  f"(largest part: {result['largest_part_difference']}); each restart's own time: "
                  f"{100 * result['goodput_difference_each_restart']:+.2f}", file=sys.stderr)
    for key in ("goodput_difference", "goodput_difference_each_restart"):
        diffs = [abs(r[key]) for r in out["runs"].values()]
        out[f"largest_{key}"] = max(diffs) if diffs else None
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
