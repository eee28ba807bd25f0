"""A driver process for tests that kill or relaunch it.

    python -m tests.integration.driver STORAGE EVENTS [--name N] [--loop counting] [--steps S] ...
Prints the final metrics as JSON on its last line.
"""

import argparse
import json

from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration import jobs

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("storage")
    p.add_argument("events")
    p.add_argument("--name", default="killed")
    p.add_argument("--loop", default="sleepy_loop")
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--max-failures", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--named", action="store_true", help="report(checkpoint_dir_name='step_S')")
    args = p.parse_args()
    result = Trainer(getattr(jobs, args.loop),
                     train_loop_config={"events": args.events, "steps": args.steps, "every": args.every,
                                        "step_sleep": args.step_sleep, "named": args.named},
                     scaling_config=ScalingConfig(num_workers=args.workers),
                     run_config=RunConfig(name=args.name, storage_path=args.storage,
                                          failure_config=FailureConfig(max_failures=args.max_failures))).fit()
    print(json.dumps(result.last_metrics))
