"""Train functions of a worker that attacks its node through the controller: it sends frames it builds itself,
as a worker that does not run outlast's code would."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

from outlast.protocol.transport import HEADER
from outlast.storage.checksum import hash_file
from outlast.train import get_context
from outlast.train._session import get_session


def report_outside_loop(config: dict) -> None:
    """Report a checkpoint whose one file is `config["path"]` (relative to `config["local_dir"]`, where the
    bytes are), then wait to be stopped."""
    ctx = get_context()
    payload = Path(config["local_dir"]) / config["path"]
    size, digest = hash_file(payload)
    session = get_session("report_outside_loop")
    session._sock.send(HEADER + msgspec.msgpack.encode({
        "type": "Report", "attempt": ctx.get_attempt(), "rank": ctx.get_world_rank(), "index": 0,
        "metrics": {"step": 0}, "checkpoint_dir": f"checkpoint_{ctx.get_attempt():03d}_000000",
        "files": [{"path": config["path"], "size": size, "xxh3_128": digest}], "local_dir": config["local_dir"]}))
    time.sleep(config.get("wait_s", 30))
