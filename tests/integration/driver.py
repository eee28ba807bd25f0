"""A driver process for tests that kill it: `python -m tests.integration.driver STORAGE EVENTS`."""

import sys

from outlast.train import RunConfig, ScalingConfig, Trainer
from tests.integration.jobs import sleepy_loop

if __name__ == "__main__":
    storage, events = sys.argv[1], sys.argv[2]
    Trainer(sleepy_loop, train_loop_config={"events": events, "steps": 100000},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="killed", storage_path=storage)).fit()
