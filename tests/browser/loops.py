"""Train functions of the dashboard's tests: a loss that falls, reported every step, checkpointed
every `every` steps, a just-in-time checkpoint on a drain, and one injected fault (jobs._fault)."""

from __future__ import annotations

import json
import os
import tempfile
import time

from outlast import train
from outlast.train import Checkpoint
from tests.integration.jobs import _fault, _restored_start, log_event


def _checkpoint(step: int) -> Checkpoint:
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "state.json"), "w") as f:
        json.dump({"step": step}, f)
    return Checkpoint.from_directory(d)


def charted_loop(config: dict) -> None:
    ctx = train.get_context()
    start, _ = _restored_start()
    log_event(config, event="start", restored_step=start - 1 if start else None, world=ctx.get_world_size())
    noticed = False
    for step in range(start, config["steps"]):
        train.collective.barrier()  # lock step, as a gradient all-reduce would
        _fault(config, step, "before_report")
        info = train.get_preemption_info()
        due = (step + 1) % config.get("every", 5) == 0 or (info is not None and not noticed)
        noticed = noticed or info is not None
        checkpoint = _checkpoint(step) if due and ctx.get_world_rank() == 0 else None
        train.report({"step": step, "loss": 1.0 / (1 + 0.1 * step), "world": ctx.get_world_size()},
                     checkpoint=checkpoint)
        log_event(config, event="step", step=step)
        if config.get("print"):
            print(f"rank {ctx.get_world_rank()} step {step}", flush=True)
        time.sleep(config.get("step_sleep", 0.0))
