"""The pipe that wakes the controller's loop when answers wait for it in an executor.

Any thread rings it (one byte); the loop empties it before it takes the answers. Closing it is safe
while threads may still ring: they find it closed, and never write into a descriptor reused since.
"""

from __future__ import annotations

import os
import threading


class Wakeup:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    def fileno(self) -> int:
        """Readable when a thread has rung since the last `clear()`."""
        return self._read_fd

    def ring(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"x")
            except (BlockingIOError, OSError):
                pass  # the pipe is full: the loop has a wake-up waiting already

    def clear(self) -> None:
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._read_fd)
            os.close(self._write_fd)
