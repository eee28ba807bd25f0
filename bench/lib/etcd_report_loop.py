"""The loop the etcd benchmark times: `n` report() calls without a checkpoint, each timed inside the worker."""

from __future__ import annotations

import json
import time

from outlast import train


def timed_reports(config: dict) -> None:
    costs = []
    for step in range(config["n"]):
        t = time.perf_counter()
        train.report({"step": step})
        costs.append(time.perf_counter() - t)
    if train.get_context().get_world_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump(costs, f)
