"""Train functions for the tests of small promises, importable by the workers."""

from __future__ import annotations

import os
import time

from outlast import train


def returns_then_fails(config: dict):
    """Attempt 1: rank 0 returns "stale", then rank 1 raises once rank 0's return value is stored.
    Later attempts return None on every rank."""
    ctx = train.get_context()
    if ctx.get_attempt() > 1:
        return None
    if ctx.get_world_rank() == 0:
        return "stale"
    end = time.monotonic() + 60.0
    while not os.path.exists(config["return_file"]) and time.monotonic() < end:
        time.sleep(0.05)
    raise RuntimeError("rank 1 fails after rank 0 returned")


def reports_once(config: dict):
    train.report({"step": 0})
    return "done"
