"""A train loop for the duplicate-file tests: every rank saves `model.pt` with its own bytes, as
Ray's tutorial does, in an order the test sets: one rank uploads only once the other's copy
is in storage."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from outlast import train
from outlast.storage import open_storage
from outlast.storage.naming import default_name
from outlast.train import Checkpoint


def model_bytes(rank: int) -> bytes:
    return f"rank {rank} model".encode() * 1000


def every_rank_saves_model_pt(config: dict) -> None:
    ctx = train.get_context()
    rank = ctx.get_world_rank()
    if rank == config["last"]:
        # Wait for the other rank's copy to be stored, so this rank's upload comes last.
        other = 1 - rank
        stored = f"{config['name']}/{default_name(ctx.get_attempt(), 0)}/model.pt"
        storage, deadline = open_storage(config["storage"]), time.monotonic() + 120
        while True:
            try:
                if storage.read_bytes(stored) == model_bytes(other):
                    break
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {other}'s model.pt never reached {stored}")
            time.sleep(0.05)
    with tempfile.TemporaryDirectory() as d:
        Path(d, "model.pt").write_bytes(model_bytes(rank))
        Path(d, f"rank{rank}.txt").write_text(str(rank))
        train.report({"step": 0}, checkpoint=Checkpoint.from_directory(d))
