"""Storage for the simulator: a dict of path -> bytes with seeded faults, and the executor of a driver's
storage effects on the virtual clock.

Slowness is time the caller spends: every operation adds `latency_s` (or, within a slow window,
that window's latency) to `spent`, and the simulated process that called it stays busy that long;
an operation happens at the virtual instant its caller reaches it (`clock() + spent`). Failing
windows raise OSError; a bucket without delete permission raises PermissionError on every delete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from outlast.controller import effects as fx
from outlast.controller import storage_io
from outlast.controller.executor import SLOW_AGAIN_S, SLOW_S, EffectQueue
from outlast.storage.retry import DEFAULT_RETRY_S, Retrying
from outlast.storage.run_store import RunStore


class SimStorage:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.files: dict[str, bytes] = {}
        self.latency_s = 0.0
        self.failing: list[tuple[float, float]] = []  # [start, end) windows where every operation fails
        self.refuse_deletes = False
        self.slow: list[tuple[float, float, float]] = []  # [start, end) windows where each operation takes latency
        self.spent = 0.0

    def _op(self, what: str, path: str) -> None:
        now = self.clock() + self.spent
        self.spent += max([self.latency_s] + [lat for a, b, lat in self.slow if a <= now < b])
        if any(a <= now < b for a, b in self.failing):
            raise OSError(f"simulated storage failure: {what} {path}")

    def spend(self, seconds: float) -> None:
        """The caller waits (a retry's backoff): virtual time it is busy."""
        self.spent += seconds

    def take_spent(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent

    def write_atomic(self, path: str, data: bytes) -> None:
        self._op("write", path)
        self.files[path] = bytes(data)

    def read_bytes(self, path: str) -> bytes:
        self._op("read", path)
        try:
            return self.files[path]
        except KeyError:
            raise FileNotFoundError(path) from None

    def read_head(self, path: str, n: int) -> bytes:
        return self.read_bytes(path)[:n]

    def size(self, path: str) -> int:
        return len(self.read_bytes(path))

    def exists(self, path: str) -> bool:
        self._op("exists", path)
        return path in self.files or any(p.startswith(path.rstrip("/") + "/") for p in self.files)

    def list_dirs(self, path: str) -> list[str]:
        self._op("list", path)
        prefix = path.strip("/") + "/"
        return sorted({p[len(prefix):].split("/")[0] for p in self.files
                       if p.startswith(prefix) and "/" in p[len(prefix):]})

    def delete(self, path: str) -> None:
        self._op("delete", path)
        if self.refuse_deletes:
            raise PermissionError(f"simulated AccessDenied: delete {path}")
        self.files = {p: b for p, b in self.files.items() if p != path and not p.startswith(path + "/")}

    def upload_dir(self, local_dir: Path, dest: str) -> list:
        raise NotImplementedError("simulated workers write their files with write_atomic")

    def local_path(self, path: str) -> Path | None:
        return None

    def uri(self, path: str) -> str:
        return f"sim://{path}"


class SimStorageExecutor:
    """A driver's storage effects, carried out one after another on the virtual clock: each takes what its
    calls spend, and its answer reaches the driver when it is done (`deliver`), as the driver's executor
    thread does. A call past `SLOW_S` is told, as there."""

    def __init__(self, sim, storage: SimStorage, deliver: Callable[[fx.StorageEvent], None],
                 escaped: Callable[[fx.StorageEffect, Exception], None]) -> None:
        self._world = sim.world
        self._escaped = escaped
        self._storage = storage
        self._store = RunStore(storage, "run")
        self._deliver = deliver
        self._queue = EffectQueue()
        self._busy = False
        self._stopped = False

    def submit(self, effect: fx.StorageEffect) -> None:
        self._queue.push(effect)
        if not self._busy:
            self._next()

    def stop(self) -> None:
        """The driver died: what it had not handed over yet is never carried out."""
        self._stopped = True

    def _next(self) -> None:
        if self._stopped:
            return
        effect, answered = self._queue.pop()
        for done in answered:
            self._deliver(done)
        if effect is None:
            self._busy = False
            return
        self._busy = True
        storage, world = self._storage, self._world
        saved, storage.spent = storage.spent, 0.0
        try:
            event = storage_io.perform(effect, self._store, lambda: Retrying(DEFAULT_RETRY_S, sleep=storage.spend))
        except Exception as e:  # noqa: BLE001 - an escape is what the simulator looks for
            storage.spent = saved
            self._stopped = True
            self._escaped(effect, e)
            return
        took, storage.spent = storage.spent, saved
        told = SLOW_S
        while told <= took:
            world.after(told, self._deliver, fx.StorageSlow(effect.id, fx.describe(effect), told))
            told += SLOW_AGAIN_S
        world.after(took, self._done, event)

    def _done(self, event: fx.StorageEvent) -> None:
        self._deliver(event)
        self._next()
