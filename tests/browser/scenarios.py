"""Real runs for the dashboard's tests, on a LocalCluster of one-CPU nodes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.browser.loops import charted_loop
from tests.integration.jobs import read_events
from tests.integration.procs import wait_until

STEPS = 40


@contextlib.contextmanager
def failure_drain_resize(storage_path: str, events, steps: int = STEPS) -> Iterator[LocalCluster]:
    """Attempt 1 on 3 nodes loses rank 1 to SIGKILL at step 8 (a worker failure); attempt 2 on the same 3
    is drained off node-2 at step 20 with a 30 s deadline and saves; attempt 3 goes on at 2 workers (a
    resize) to the end. The cluster stays up inside the block: its nodes keep the ranks' output files."""
    with LocalCluster(num_nodes=3, cpus_per_node=1) as cluster:
        def drain() -> None:
            wait_until(lambda: any(e["event"] == "step" and e["attempt"] == 2 and e["step"] >= 20
                                   for e in read_events(events)), 240, "attempt 2 at step 20")
            cluster.drain_node("node-2", deadline_s=30, message="spot instance reclaimed")

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        Trainer(charted_loop,
                train_loop_config={"events": str(events), "steps": steps, "every": 5, "step_sleep": 0.05,
                                   "print": True, "fault": {"rank": 1, "step": 8, "when": "before_report",
                                                            "kind": "kill"}},
                scaling_config=ScalingConfig(num_workers=(2, 3), resources_per_worker={"CPU": 1}),
                run_config=RunConfig(name="story", storage_path=storage_path,
                                     failure_config=FailureConfig(max_failures=1))).fit()
        t.join()
        yield cluster
