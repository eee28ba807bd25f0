"""The workers' output on the driver's terminal: every rank's lines, prefixed `[rank R NODE aA]`.

The controller's loop hands each `WorkerOutput` over and goes on; a thread of its own writes
them, so a slow terminal never slows the controller (and through it the ranks' reports).
What waits is bounded (`MAX_QUEUED_LINES`); lines beyond it, and lines a node never sent (a gap
in a rank's sequence numbers), are counted and said in a line of their own.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from typing import Callable, TextIO

from outlast.protocol import messages as m

MAX_QUEUED_LINES = 200_000


def prefix(rank: int, node_id: str, attempt: int) -> str:
    return f"[rank {rank} {node_id} a{attempt}] "


def not_shown(count: int, rank: int, attempt: int) -> str:
    return (f"{count} line(s) of rank {rank} (attempt {attempt}) not shown: written faster than they could be "
            f"forwarded, or cut from the rank's log file past its size cap (OUTLAST_WORKER_OUTPUT_MAX_BYTES); what "
            f"the file holds: outlast runs STORAGE NAME --logs {rank}")


class OutputPrinter:
    """Called with each `WorkerOutput`; `close()` writes what is left and stops the thread."""

    def __init__(self, prefixed: bool = True, stream: Callable[[], TextIO] = lambda: sys.stdout,
                 max_queued: int = MAX_QUEUED_LINES) -> None:
        self.prefixed = prefixed
        self._stream = stream
        self._max = max_queued
        self._queue: deque[tuple[str, list[str]]] = deque()
        self._queued = 0
        self._next: dict[tuple[str, int, int], int] = {}  # (run, attempt, rank) -> the next line expected
        self.not_shown = 0  # over the run: lines counted and said instead of shown
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._write_loop, name="outlast-worker-output", daemon=True)
        self._thread.start()

    def __call__(self, msg: m.WorkerOutput) -> None:
        key = (msg.run_id, msg.attempt, msg.rank)
        gap = msg.seq - self._next.get(key, 0)
        self._next[key] = msg.seq + len(msg.lines)
        head = prefix(msg.rank, msg.node_id, msg.attempt) if self.prefixed else ""
        with self._cond:
            if gap > 0:
                self._put(head, [not_shown(gap, msg.rank, msg.attempt)])
                self.not_shown += gap
            if self._queued + len(msg.lines) > self._max:
                self.not_shown += len(msg.lines)
                self._put(head, [not_shown(len(msg.lines), msg.rank, msg.attempt)])
            elif msg.lines:
                self._put(head, msg.lines)
            self._cond.notify()

    def _put(self, head: str, lines: list[str]) -> None:
        self._queue.append((head, lines))
        self._queued += len(lines)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue and self._closed:
                    return
                batch = list(self._queue)
                self._queue.clear()
                self._queued = 0
            text = "".join(f"{head}{line}\n" for head, lines in batch for line in lines)
            try:
                out = self._stream()
                # On a terminal, over the progress line (outlast/controller/progress.py) if one is shown:
                # it is drawn again under these lines at its next redraw.
                out.write(("\r\x1b[K" + text) if out.isatty() else text)
                out.flush()
            except (OSError, ValueError):
                pass  # a closed terminal: the lines stay in the ranks' log files

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)
