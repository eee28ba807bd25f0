"""A progress line on the driver's terminal while a run waits for something a person would wait
for: capacity (what is missing), a restore being fetched (bytes, rate), a preemption (its deadline
counting down), a relaunched driver's predecessor's lease, a storage call that is slow.

`describe` decides what to say from the controller's state and what the workers told (pure, time
as arguments); `ProgressLine` shows it: one line rewritten in place on a terminal, on stderr;
plain log lines, when the wait changes and every `PLAIN_EVERY_S`, when stderr is not a terminal.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TextIO

from outlast.controller import group as g
from outlast.controller import states as st
from outlast.protocol import messages as m

if TYPE_CHECKING:
    from outlast.controller.core import ControllerCore
    from outlast.controller.effects import StorageEffect, StorageSlow, TierAsk

log = logging.getLogger("outlast.progress")

REDRAW_S = 0.25  # a terminal's line at most this often
PLAIN_EVERY_S = 10.0  # a log line at most this often while the same wait goes on


@dataclass
class Fetch:
    """A restore being fetched, as the ranks report it (the slowest rank is what the run waits on)."""

    checkpoint: str
    attempt: int
    done: dict[int, int]  # rank -> bytes fetched
    total: int  # bytes of the checkpoint
    started: float
    finished: set[int]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def describe(state: st.AnyState, fetch: Fetch | None, now: float, capacity_s: float,
             storage_slow: "StorageSlow | None" = None) -> tuple[str, str] | None:
    """(what is waited for, the line) or None when nothing a person waits on is going on."""
    if storage_slow is not None:
        return "storage", (f"storage is slow: {storage_slow.what} ({storage_slow.for_s:.0f} s so far); training goes "
                           "on, and what waits on it (a commit) waits")
    if isinstance(state, st.WaitingForCapacity):
        waited = now - state.since
        return "capacity", (f"waiting for capacity: {state.reason} (waited {waited:.0f} s, gives up in "
                            f"{max(0.0, capacity_s - waited):.0f} s)")
    if isinstance(state, st.Preempting):
        p = state.preemption
        return "preemption", (f"preemption of node(s) {', '.join(p.node_ids)}: saving a checkpoint, restart in at "
                              f"most {max(0.0, p.deadline - now):.0f} s")
    if isinstance(state, st.Saved):
        p = state.preemption
        return "preemption", (f"preemption of node(s) {', '.join(p.node_ids)}: {state.checkpoint} committed, waiting "
                              f"for room elsewhere; restart in at most {max(0.0, p.deadline - now):.0f} s")
    if fetch is not None and len(fetch.finished) < len(fetch.done):
        slowest = min(fetch.done[r] for r in fetch.done if r not in fetch.finished)
        rate = slowest / max(now - fetch.started, 1e-3)
        return "restore", (f"restoring {fetch.checkpoint}: {_bytes(slowest)} of {_bytes(fetch.total)} fetched "
                           f"({_bytes(rate)}/s)")
    return None


def lease_line(reason: str, left_s: float) -> str:
    return f"waiting for the previous driver's lease: {reason} ({max(0.0, left_s):.0f} s left)"


class ProgressLine:
    """A watcher of the controller's loop (see runtime.Controller) that shows what the run waits on."""

    def __init__(self, stream: Callable[[], TextIO] = lambda: sys.stderr, tty: bool | None = None,
                 capacity_s: float = 600.0) -> None:
        self._stream = stream
        self._tty = stream().isatty() if tty is None else tty
        self._capacity_s = capacity_s
        self._fetch: Fetch | None = None
        self._shown: tuple[str, str] | None = None
        self._last_draw = float("-inf")

    def observe(self, event: Any, effects: list[g.Effect | StorageEffect | TierAsk], core: "ControllerCore",
                start: float, end: float) -> None:
        if isinstance(event, g.FromWorker) and isinstance(event.msg, m.RestoreProgress):
            self._on_restore(event.msg, start)
        if self._fetch is not None and core.attempt is not None and core.attempt.number != self._fetch.attempt:
            self._fetch = None
        self.show(describe(core.state, self._fetch, start, self._capacity_s, core.storage_slow), start)

    def _on_restore(self, msg: m.RestoreProgress, now: float) -> None:
        f = self._fetch
        if f is None or f.attempt != msg.attempt or f.checkpoint != msg.checkpoint_dir:
            f = self._fetch = Fetch(msg.checkpoint_dir, msg.attempt, {}, msg.total_bytes, now, set())
        f.done[msg.rank] = msg.fetched_bytes
        if msg.finished:
            f.finished.add(msg.rank)

    def show(self, what: tuple[str, str] | None, now: float) -> None:
        """Draw `what` (None: the wait is over)."""
        if what is None:
            if self._shown is not None and self._tty:
                self._write("\r\x1b[K")
            elif self._shown is not None:
                log.info("no longer waiting for %s", self._shown[0])
            self._shown = None
            return
        changed = self._shown is None or self._shown[0] != what[0]
        if self._tty and (changed or now - self._last_draw >= REDRAW_S):
            self._write(f"\r\x1b[K{what[1]}")
            self._last_draw = now
        elif not self._tty and (changed or now - self._last_draw >= PLAIN_EVERY_S):
            log.info("%s", what[1])
            self._last_draw = now
        self._shown = what

    def close(self) -> None:
        self.show(None, 0.0)

    def _write(self, text: str) -> None:
        try:
            out = self._stream()
            out.write(text)
            out.flush()
        except (OSError, ValueError):
            pass
