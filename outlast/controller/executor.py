"""Carrying out the core's storage effects off the controller's loop.

`EffectQueue` is the order they are carried out in (the one both executors share): first in,
first out, except that a run-state write writes the newest state queued, and a later write of a
state already written is answered without a call. `StorageExecutor` runs the queue on a thread
of the driver; its answers wait in `take()`, and a byte on `wake_fd` wakes the loop for them. A
call that runs past `SLOW_S` is told as `StorageSlow` (and again every `SLOW_AGAIN_S`). The
simulator's executor (`outlast/sim/storage.py`) runs the same queue and `storage_io.perform` on
its virtual clock.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from typing import Callable

import tenacity

from outlast.controller import effects as fx
from outlast.controller import storage_io
from outlast.controller.wakeup import Wakeup
from outlast.storage.retry import retry_budget_s, Retrying
from outlast.storage.run_store import RunStore
from outlast.trace import mark

log = logging.getLogger("outlast.controller")

SLOW_S = 5.0
SLOW_AGAIN_S = 30.0


class EffectQueue:
    def __init__(self) -> None:
        self._todo: deque[fx.StorageEffect] = deque()
        self._written: bytes | None = None

    def push(self, effect: fx.StorageEffect) -> None:
        self._todo.append(effect)

    def __len__(self) -> int:
        return len(self._todo)

    def pop(self) -> tuple[fx.StorageEffect | None, list[fx.StorageDone]]:
        """The next effect to carry out (None: nothing left), and those answered without a call."""
        answered = []
        while self._todo:
            effect = self._todo.popleft()
            if isinstance(effect, fx.WriteRunState):
                if effect.data is self._written:
                    answered.append(fx.StorageDone(effect.id))
                    continue
                newest = next((e for e in reversed(self._todo) if isinstance(e, fx.WriteRunState)), effect)
                # A newer state may go first: it names a checkpoint only once its manifest is written, and
                # stops naming one before that one's delete, so it is never ahead of what storage holds.
                effect = dataclasses.replace(effect, data=newest.data,
                                             names_commit=effect.names_commit or newest.names_commit)
                self._written = newest.data
            return effect, answered
        return None, answered


class StorageExecutor:
    """The core's storage effects, in order, on a thread of their own."""

    def __init__(self, store: RunStore, retry_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 slow_s: float = SLOW_S) -> None:
        self._store = store
        self._budget = retry_budget_s() if retry_s is None else retry_s
        self._clock = clock
        self._slow_s = slow_s
        self._queue = EffectQueue()
        self._cv = threading.Condition()
        self._answers: deque[fx.StorageEvent] = deque()
        self._current: tuple[fx.StorageEffect, float] | None = None
        self._slow_told: dict[int, float] = {}  # effect id -> how long it had run when last told
        self._stop = False
        self._wakeup = Wakeup()
        self._thread = threading.Thread(target=self._run, name="outlast-storage", daemon=True)
        self._thread.start()

    @property
    def wake_fd(self) -> int:
        """Readable when answers are waiting in `take()`."""
        return self._wakeup.fileno()

    def submit(self, effect: fx.StorageEffect) -> None:
        with self._cv:
            self._queue.push(effect)
            self._cv.notify()

    def take(self) -> list[fx.StorageEvent]:
        self._wakeup.clear()
        with self._cv:
            out = list(self._answers)
            self._answers.clear()
            current = self._current
        if current is not None:
            effect, started = current
            ran = self._clock() - started
            told = self._slow_told.get(effect.id)
            if ran >= self._slow_s and (told is None or ran - told >= SLOW_AGAIN_S):
                self._slow_told[effect.id] = ran
                out.append(fx.StorageSlow(effect.id, fx.describe(effect), ran))
        return out

    def close(self, timeout_s: float | None = None) -> None:
        """Stop once what was handed over is carried out (or after `timeout_s`)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("storage is still busy with %s; not waiting for it",
                        fx.describe(self._current[0]) if self._current else "what the run handed it")
            return
        self._wakeup.close()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not len(self._queue) and not self._stop:
                    self._cv.wait()
                effect, answered = self._queue.pop()
                self._answers.extend(answered)
                if effect is None:
                    self._wakeup.ring()
                    if self._stop:
                        return
                    continue
                self._current = (effect, self._clock())
            kind = type(effect).__name__
            mark("storage.begin", effect=kind)
            try:
                event = storage_io.perform(effect, self._store,
                                           lambda: Retrying(self._budget, on_retry=self._say_retry))
            except Exception as e:  # noqa: BLE001 - the loop must hear of it, or it waits for ever
                log.exception("storage effect %s raised", fx.describe(effect))
                event = fx.StorageFailed(effect.id, fx.describe(effect), f"{type(e).__name__}: {e}")
            mark("storage.end", effect=kind)
            with self._cv:
                self._current = None
                self._answers.append(event)
            self._wakeup.ring()

    def _say_retry(self, state: tenacity.RetryCallState) -> None:
        e = state.outcome.exception() if state.outcome is not None else None
        log.warning("storage call failed (%s); retrying in %.1f s (for %.0f s of waiting in all: "
                    "OUTLAST_STORAGE_RETRY_S)", e, state.next_action.sleep if state.next_action else 0.0,
                    self._budget)
