"""Work run by the real-kernel tests' workers and tasks (importable by name in the workers)."""

from __future__ import annotations

import os
import time

from outlast import train

MiB = 1024**2


def touch(mib: int) -> bytearray:
    buf = bytearray(mib * MiB)
    for i in range(0, len(buf), 4096):
        buf[i] = 1
    return buf


def steady(mib: int, seconds: float, release: str | None = None) -> str:
    """Hold `mib` for `seconds`, or until the file `release` exists."""
    held = touch(mib)
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (release and os.path.exists(release)):
        time.sleep(0.05)
    return f"steady done ({len(held) // MiB} MiB)"


def hog(total_mib: int) -> str:
    chunks = []
    for _ in range(total_mib // 50):
        chunks.append(touch(50))
    return "the hog finished: the limit did not hold"


def train_then_hog(config: dict) -> None:
    """Attempt 1: commit one checkpoint, then rank 0 eats memory. Later attempts finish."""
    import tempfile

    ctx = train.get_context()
    if train.get_checkpoint() is None:
        with tempfile.TemporaryDirectory() as d:
            open(os.path.join(d, "state.txt"), "w").write("1")
            train.report({"step": 1}, checkpoint=train.Checkpoint.from_directory(d) if ctx.get_world_rank() == 0
                         else None)
        if ctx.get_world_rank() == 0:
            hog(config["hog_mib"])
        time.sleep(60)
    train.report({"step": 2, "restored": True})
