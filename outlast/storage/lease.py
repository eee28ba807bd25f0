"""The driver lease: one live driver per run, and a dead driver's run taken over safely.

The lease names its holder: its host (machine id, boot id and pid namespace, so two machines
sharing a hostname are two hosts) and its process (pid and start time, so a reused pid is not
mistaken for the holder). A driver on the holder's host can tell at once that the holder is
dead. From another host, expiry is judged by the reader alone: it watches the lease on its own
monotonic clock and takes over once no renewal came for a whole TTL, so no two machines'
clocks are ever compared. Every change is a compare-and-swap on storage
(`outlast.storage.conditional`): of two drivers that race, exactly one wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import msgspec

from outlast.identity import same_start


LEASE_VERSION = 2  # the newest lease this outlast reads: a newer one is refused (`RunStore.read_lease`)


class Lease(msgspec.Struct, kw_only=True):
    version: int = LEASE_VERSION
    driver_id: str
    host: str  # outlast.identity.host_id(); a hostname in leases written before version 2
    hostname: str = ""  # for people: which machine that is
    pid: int
    pid_started_at: float
    acquired_at: float
    renewed_at: float  # wall clock, for the run's history only: never compared across hosts
    renewals: int = 0  # every renewal changes the document, so a reader sees it did
    ttl_s: float
    released: bool = False  # the holder finished and let go

    def who(self) -> str:
        return f"pid {self.pid} on {self.hostname or self.host}"


@dataclass(frozen=True)
class TakeoverDecision:
    allowed: bool
    reason: str
    wait: bool = False  # not yet: watch the lease longer (its holder is on another host)


def decide_takeover(current: Lease | None, host: str, unchanged_for_s: float,
                    holder_alive: Callable[[Lease], bool]) -> TakeoverDecision:
    """Pure: may a new driver on `host` take the run?

    `unchanged_for_s`: for how long, on the reader's own monotonic clock, it has seen this very
    version of the lease. `holder_alive(lease)` checks the holder's pid on this host.
    """
    if current is None or current.released:
        return TakeoverDecision(True, "the run has no driver")
    who = current.who()
    if current.host == host:
        if not holder_alive(current):
            return TakeoverDecision(True, f"its previous driver ({who}) is dead")
        return TakeoverDecision(False, f"it is being driven by {who}, alive")
    if unchanged_for_s >= current.ttl_s:
        return TakeoverDecision(True, f"its previous driver ({who}) did not renew its lease for "
                                      f"{unchanged_for_s:.1f} s (its TTL is {current.ttl_s:.0f} s)")
    return TakeoverDecision(False, f"it is being driven by {who}, on another host: it counts as gone once "
                                   f"its lease goes {current.ttl_s:.0f} s without a renewal", wait=True)


def holder_alive(lease: Lease) -> bool:
    import psutil

    try:
        return same_start(psutil.Process(lease.pid).create_time(), lease.pid_started_at)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def this_process(driver_id: str, now: float, ttl_s: float) -> Lease:
    import socket

    from outlast.identity import host_id, this_process as me

    proc = me()
    return Lease(driver_id=driver_id, host=host_id(), hostname=socket.gethostname(), pid=proc.pid,
                 pid_started_at=proc.started_at, acquired_at=now, renewed_at=now, ttl_s=ttl_s)
