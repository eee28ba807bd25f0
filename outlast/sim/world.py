"""The simulator's virtual time: one queue of timed callbacks, and FIFO channels with delays."""

from __future__ import annotations

import heapq
import random
from typing import Any, Callable


class World:
    def __init__(self, rng: random.Random, trace: bool = False) -> None:
        self.rng = rng
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0
        self.tracing = trace
        self.stopped = False  # the run closed, or broke an invariant: nothing more happens
        self.trace: list[str] = []

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (t if t > self.now else self.now, self._seq, fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        t = self.now + dt
        self._seq += 1
        heapq.heappush(self._queue, (t if t > self.now else self.now, self._seq, fn, args))

    def run_until(self, t_end: float) -> None:
        """Until `t_end`, or until `stopped` (looked at before every callback: a flag, not a call)."""
        q, pop = self._queue, heapq.heappop
        while q and not self.stopped:
            if q[0][0] > t_end:
                break
            t, _, fn, args = pop(q)
            self.now = t
            fn(*args)

    def note(self, what: str) -> None:
        """Call only as `if world.tracing: world.note(...)` where building the text costs."""
        if self.tracing:
            self.trace.append(f"{self.now:10.4f} {what}")


class Channel:
    """One connection: messages arrive in the order sent, each after a delay of at most `max_delay_s`
    (ZeroMQ over TCP keeps order per connection and loses nothing while both ends live)."""

    def __init__(self, world: World, max_delay_s: float) -> None:
        self.world = world
        self.max_delay_s = max_delay_s
        self._last = 0.0
        self.open = True
        self.in_flight = 0

    def send(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self.open:
            return
        w = self.world
        t = w.now + w.rng.random() * self.max_delay_s
        if t < self._last:
            t = self._last
        self._last = t
        self.in_flight += 1
        w._seq += 1  # as `at` does, on the path of every message: never before now
        heapq.heappush(w._queue, (t, w._seq, self._deliver, (fn, args)))

    def _deliver(self, fn, args) -> None:
        self.in_flight -= 1
        if self.open:
            fn(*args)
