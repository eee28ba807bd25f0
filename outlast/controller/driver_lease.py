"""Holding a run's driver lease: acquire before touching the run, renew while driving it."""

from __future__ import annotations

import logging
import socket
import time
import uuid

from outlast.storage.lease import Lease, decide_takeover, holder_alive, this_process
from outlast.storage.run_store import RunStore
from outlast.errors import RunInUseError

log = logging.getLogger("outlast.controller")


class LeaseKeeper:
    def __init__(self, store: RunStore, ttl_s: float, clock=time.monotonic, wall=time.time) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.clock = clock
        self.wall = wall
        self.driver_id = uuid.uuid4().hex
        self.previous: Lease | None = None  # the lease we took over, if any
        self._next_renewal = 0.0

    def acquire(self, wait_s: float | None = None) -> None:
        """Take the lease, or raise `RunInUseError` naming the driver that holds it.

        A holder on another host cannot be checked directly: wait (at most its TTL) for its
        lease to expire, and give up if it is renewed meanwhile.
        """
        host = socket.gethostname()
        deadline = self.clock() + (self.ttl_s if wait_s is None else wait_s)
        first_seen: Lease | None = None
        while True:
            current = self.store.read_lease()
            decision = decide_takeover(current, host, self.wall(), holder_alive)
            if decision.allowed:
                break
            assert current is not None
            renewed = first_seen is not None and current.renewed_at != first_seen.renewed_at
            if current.host == host or renewed or self.clock() >= deadline:
                raise RunInUseError(
                    f"run {self.store.storage.uri(self.store.run_dir)} is in use: {decision.reason}. "
                    "Stop that driver first, or give this run another RunConfig(name=...)"
                )
            if first_seen is None:
                first_seen = current
                log.info("waiting for the driver lease of %s: %s", self.store.run_dir, decision.reason)
            time.sleep(min(1.0, max(0.05, deadline - self.clock())))
        if current is not None:
            log.info("taking over run %s: %s", self.store.run_dir, decision.reason)
        self.previous = current
        self.store.write_lease(this_process(self.driver_id, self.wall(), self.ttl_s))
        # Two drivers racing for a free run both write; the one whose lease is read back wins.
        time.sleep(0.05)
        winner = self.store.read_lease()
        if winner is None or winner.driver_id != self.driver_id:
            raise RunInUseError(
                f"run {self.store.storage.uri(self.store.run_dir)} was taken by another driver just now"
                + (f" (pid {winner.pid} on {winner.host})" if winner else "")
            )
        self._next_renewal = self.clock() + self.ttl_s / 3

    def renew_if_due(self, now: float) -> str | None:
        """Renew the lease; return why we lost it, if another driver took it."""
        if now < self._next_renewal:
            return None
        self._next_renewal = now + self.ttl_s / 3
        try:
            current = self.store.read_lease()
        except OSError as e:
            log.warning("could not read the driver lease of %s: %s", self.store.run_dir, e)
            return None
        if current is not None and current.driver_id != self.driver_id:
            return (f"another driver (pid {current.pid} on {current.host}) took over this run's lease; "
                    "this driver stops so that two drivers never write one run")
        lease = this_process(self.driver_id, self.wall(), self.ttl_s)
        if current is not None:
            lease.acquired_at = current.acquired_at
        try:
            self.store.write_lease(lease)
        except OSError as e:
            # Storage trouble must not stop training; a lease that expires meanwhile is only a
            # risk if someone relaunches this run on another host in that window.
            log.warning("could not renew the driver lease of %s: %s", self.store.run_dir, e)
        return None

    def release(self) -> None:
        current = self.store.read_lease()
        if current is not None and current.driver_id == self.driver_id:
            self.store.delete_lease()
