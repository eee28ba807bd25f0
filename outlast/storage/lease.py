"""The driver lease: one live driver per run, and a dead driver's run taken over at once.

The lease names its holder (host, pid and the process's start time, so a reused pid
is not mistaken for the holder). A driver on the same host can tell that the holder
is dead and takes over immediately; from another host it waits for the lease to
expire, which the holder prevents by renewing it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import msgspec
import psutil


class Lease(msgspec.Struct, kw_only=True):
    version: int = 1
    driver_id: str
    host: str
    pid: int
    pid_started_at: float
    acquired_at: float
    renewed_at: float
    ttl_s: float


@dataclass(frozen=True)
class TakeoverDecision:
    allowed: bool
    reason: str


def decide_takeover(current: Lease | None, host: str, now: float, holder_alive) -> TakeoverDecision:
    """Pure: may a new driver on `host` take the run? `holder_alive(lease)` checks a same-host pid."""
    if current is None:
        return TakeoverDecision(True, "the run has no driver")
    who = f"pid {current.pid} on {current.host}"
    if current.host == host and not holder_alive(current):
        return TakeoverDecision(True, f"its previous driver ({who}) is dead")
    age = now - current.renewed_at
    if age > current.ttl_s:
        return TakeoverDecision(True, f"its previous driver ({who}) last renewed its lease {age:.1f} s ago")
    if current.host == host:
        return TakeoverDecision(False, f"it is being driven by {who}, alive (lease renewed {age:.1f} s ago)")
    return TakeoverDecision(False, f"it is being driven by {who} (lease renewed {age:.1f} s ago; "
                                   f"it expires {current.ttl_s - age:.1f} s from now if that driver is gone)")


def this_process(driver_id: str, now: float, ttl_s: float) -> Lease:
    me = psutil.Process()
    return Lease(driver_id=driver_id, host=socket.gethostname(), pid=me.pid, pid_started_at=me.create_time(),
                 acquired_at=now, renewed_at=now, ttl_s=ttl_s)


def holder_alive(lease: Lease) -> bool:
    try:
        return abs(psutil.Process(lease.pid).create_time() - lease.pid_started_at) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True
