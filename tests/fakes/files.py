"""A real file rewritten in place by another thread for as long as a block runs: a checkpoint file that its
writer is still changing while outlast copies it."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def rewritten(path: Path, piece: int) -> Iterator[None]:
    """Pieces of `piece` bytes of `path` (its size unchanged) written over with a new byte each time, over
    and over, until the block ends."""
    size = path.stat().st_size
    stop = threading.Event()

    def rewrite() -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            fill = 0
            while not stop.is_set():
                fill = (fill + 1) % 256
                os.pwrite(fd, bytes([fill]) * piece, (fill * piece) % max(size - piece + 1, 1))
        finally:
            os.close(fd)

    writer = threading.Thread(target=rewrite, name="rewriter")
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join()
