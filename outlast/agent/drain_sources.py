"""What tells a node to drain besides a request on its socket: a cloud's preemption notice
(watched in threads) and a SIGTERM to the agent (a signal handler only sets a flag).
The agent's poll loop asks each turn what came in, so only that loop touches the sockets."""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from outlast.drain import Notice, Watcher


@dataclass(frozen=True)
class DrainAsked:
    reason: str
    message: str
    deadline_remaining_s: float | None


class DrainSources:
    def __init__(self) -> None:
        self._notices: queue.SimpleQueue[Notice] = queue.SimpleQueue()  # from the cloud watchers' threads
        self._watchers: list[Watcher] = []
        self._graceful_requested = False
        self.stop_at: float | None = None  # after a SIGTERM: when the agent stops, drained or not

    def watch_clouds(self, kinds: list[str], base_urls: dict[str, str] | None = None) -> None:
        from outlast.drain import detect_watchers

        self._watchers = [w.start() for w in detect_watchers(kinds, self._notices.put, base_urls=base_urls)]

    def request_graceful_stop(self) -> None:
        self._graceful_requested = True

    def take(self, now: float) -> list[DrainAsked]:
        """Drains that came in since the last turn (`now`: the agent's clock, for the stop deadline)."""
        orders = []
        while True:
            try:
                notice = self._notices.get_nowait()
            except queue.Empty:
                break
            left = notice.deadline_unix_s - time.time() if notice.deadline_unix_s is not None else None
            orders.append(DrainAsked("preemption", f"{notice.source}: {notice.reason}",
                                     None if left is None else max(0.0, left)))
        if self._graceful_requested and self.stop_at is None:
            timeout = float(os.environ.get("OUTLAST_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "30"))
            self.stop_at = now + timeout
            orders.append(DrainAsked("shutdown", "the node agent received SIGTERM", timeout))
        return orders

    def close(self) -> None:
        for watcher in self._watchers:
            watcher.stop()
