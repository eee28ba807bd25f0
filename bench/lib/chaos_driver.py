"""The chaos harness's driver process (killed and relaunched by the harness).

    python -m bench.lib.chaos_driver STORAGE NAME EVENTS ORDERS STEPS [--workers N]
Prints the final metrics as JSON on its last line.
"""

import argparse
import json

from outlast.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from outlast.train.torch import TorchTrainer

from bench.lib.chaos_job import chaos_loop

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("storage")
    p.add_argument("name")
    p.add_argument("events")
    p.add_argument("orders")
    p.add_argument("steps", type=int)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--every", type=int, default=5)
    args = p.parse_args()
    result = TorchTrainer(
        chaos_loop,
        train_loop_config={"events": args.events, "orders": args.orders, "steps": args.steps, "every": args.every,
                           "upload_mode": "ASYNC"},
        scaling_config=ScalingConfig(num_workers=args.workers, placement_strategy="SPREAD"),
        run_config=RunConfig(name=args.name, storage_path=args.storage, checkpoint_config=CheckpointConfig(),
                             failure_config=FailureConfig(max_failures=-1, max_preemption_failures=-1)),
    ).fit()
    print(json.dumps(result.last_metrics))
