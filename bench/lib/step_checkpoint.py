"""A checkpoint that holds a loop's step and nothing else (`state.json`): what the preemption, elastic
and Slurm loops save and restore, on Ray Train V2 or on outlast (`train` is `ray.train` or
`outlast.train`). The workers import this module: standard library only."""

from __future__ import annotations

import json
import os
import tempfile


def restored_step(train) -> int | None:
    """The step of the checkpoint the run restores from; None when it starts afresh."""
    ckpt = train.get_checkpoint()
    if ckpt is None:
        return None
    with ckpt.as_directory() as d, open(os.path.join(d, "state.json")) as f:
        return json.load(f)["step"]


def report(train, metrics: dict, step: int, save: bool) -> None:
    """`train.report(metrics)`, with a checkpoint of `step` when `save` (give it to one rank only)."""
    if not save:
        train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump({"step": step}, f)
        train.report(metrics, checkpoint=train.Checkpoint.from_directory(tmp))
