"""Holding a run's driver lease: acquire before touching the run, renew while driving it.

Every write of the lease is a compare-and-swap against the version last read or written, so a
driver whose renewal fails that way knows at once that another took the run over: it fences
the run's store (nothing more is written to the run) and stops.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Callable

import msgspec

from outlast.identity import host_id
from outlast.storage.lease import Lease, decide_takeover, holder_alive, this_process
from outlast.storage.records import NewerVersionError
from outlast.storage.run_store import RunStore
from outlast.errors import RunInUseError

log = logging.getLogger("outlast.controller")

_UNSEEN = object()


class LeaseKeeper:
    def __init__(self, store: RunStore, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 alive: Callable[[Lease], bool] = holder_alive, host: str | None = None) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.clock = clock
        self.wall = wall
        self.sleep = sleep
        self.alive = alive
        self.host = host or host_id()
        self.driver_id = uuid.uuid4().hex
        self.previous: Lease | None = None  # the lease we took over, if any
        self.lost: str | None = None  # why this driver no longer holds the run
        self._lease: Lease | None = None
        self._version: str | None = None
        self._next_renewal = 0.0

    def _in_use(self, reason: str) -> RunInUseError:
        return RunInUseError(f"run {self.store.storage.uri(self.store.run_dir)} is in use: {reason}. "
                             "Stop that driver first, or give this run another RunConfig(name=...)")

    def acquire(self, wait_s: float | None = None, on_wait: Callable[[str, float], None] | None = None) -> None:
        """Take the lease, or raise `RunInUseError` naming the driver that holds it.

        A holder on another host cannot be checked directly: watch its lease, on this
        process's monotonic clock, until it has gone a TTL without a renewal; a renewal
        meanwhile means the holder lives, and we give up at once. `on_wait(reason, seconds
        left)` is told while it waits (the driver's progress line).
        """
        started = self.clock()
        watched: object = _UNSEEN
        since = started
        logged = False
        while True:
            current, version = self.store.read_lease()
            now = self.clock()
            if watched is _UNSEEN or current is None or current.released:
                watched, since = version, now
            elif version != watched:
                raise self._in_use(f"it is being driven by {current.who()}, which renewed its lease just now")
            decision = decide_takeover(current, self.host, now - since, self.alive)
            if decision.allowed:
                break
            assert current is not None
            if not decision.wait or (wait_s is not None and now - started >= wait_s):
                raise self._in_use(decision.reason)
            if not logged:
                log.info("waiting for the driver lease of %s: %s", self.store.run_dir, decision.reason)
                logged = True
            if on_wait is not None:
                on_wait(decision.reason, since + current.ttl_s - now)
            self.sleep(min(1.0, max(0.05, since + current.ttl_s - now)))
        if current is not None and not current.released:
            log.info("taking over run %s: %s", self.store.run_dir, decision.reason)
        lease = this_process(self.driver_id, self.wall(), self.ttl_s)
        lease.host = self.host
        new_version = self.store.write_lease_if(lease, version)
        if new_version is None:
            winner, _ = self.store.read_lease()
            raise RunInUseError(f"run {self.store.storage.uri(self.store.run_dir)} was taken by another driver "
                                f"just now" + (f" ({winner.who()})" if winner else ""))
        self.previous = current if current is not None and not current.released else None
        self._lease, self._version = lease, new_version
        self._next_renewal = self.clock() + self.ttl_s / 3

    def renew_if_due(self, now: float, _adopted: bool = False) -> str | None:
        """Renew the lease; return why we lost it, if another driver took it."""
        if self.lost is not None:
            return self.lost
        if self._lease is None or now < self._next_renewal:
            return None
        self._next_renewal = now + self.ttl_s / 3
        lease = msgspec.structs.replace(self._lease, renewals=self._lease.renewals + 1, renewed_at=self.wall())
        try:
            version = self.store.write_lease_if(lease, self._version)
        except OSError as e:
            # Storage trouble must not stop training; a lease that goes a TTL without renewal
            # may be taken by a driver started meanwhile, which the next renewal finds out.
            log.warning("could not renew the driver lease of %s: %s", self.store.run_dir, e)
            return None
        if version is None:
            try:
                current, current_version = self.store.read_lease()
            except OSError:
                return None  # cannot tell yet; the next renewal asks again
            except NewerVersionError as e:
                self.lost = f"a newer outlast's driver took over this run's lease ({e}); this driver stops"
                self.store.fence(self.lost)
                return self.lost
            if current is not None and current.driver_id == self.driver_id and not current.released \
                    and not _adopted:
                # Ours: an earlier renewal was written but its answer was lost (a timeout after the
                # store applied it), so the version we held is stale. Go on from what is stored.
                self._lease, self._version = current, current_version
                self._next_renewal = now  # renew from it at once: others watch for a change
                return self.renew_if_due(now, _adopted=True)
            who = f" ({current.who()})" if current is not None else ""
            self.lost = (f"another driver{who} took over this run's lease; this driver stops and writes nothing "
                         "more to the run, so that two drivers never write one run")
            self.store.fence(self.lost)
            return self.lost
        self._lease, self._version = lease, version
        return None

    def renew_in_background(self) -> Callable[[], None]:
        """Renew on a thread of its own, so that a slow storage never holds up the controller's loop (which
        reads `lost`); returns the function that stops it."""
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(min(1.0, self.ttl_s / 6)) and self.lost is None:
                self.renew_if_due(self.clock())

        thread = threading.Thread(target=renew, name="outlast-lease", daemon=True)
        thread.start()

        def stopper() -> None:
            stop.set()
            thread.join()

        return stopper

    def release(self) -> None:
        """Let the run go (a driver started next takes it at once); nothing if we lost it."""
        if self.lost is not None or self._lease is None:
            return
        try:
            self.store.write_lease_if(msgspec.structs.replace(self._lease, released=True), self._version)
        except OSError as e:
            log.warning("could not release the driver lease of %s: %s", self.store.run_dir, e)
        self._lease = None
