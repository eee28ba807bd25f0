"""Who a process is and which machine this is, beyond what a pid or a hostname says.

A pid is reused after its process dies, and two machines can share a hostname: a record that
names a process keeps its start time and command line, and one that names a host keeps the
machine id and the boot id.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

import msgspec
import psutil


class ProcessIdentity(msgspec.Struct, frozen=True):
    pid: int
    started_at: float  # psutil's create_time: seconds since the epoch, to 10 ms
    cmdline: list[str]


def this_process() -> ProcessIdentity:
    """Read from /proc once per process: a driver names itself in every lease it takes. Keyed by the pid, so a
    forked child reads its own."""
    return _process(os.getpid())


@functools.cache
def _process(pid: int) -> ProcessIdentity:
    me = psutil.Process(pid)
    return ProcessIdentity(pid=me.pid, started_at=me.create_time(), cmdline=me.cmdline())


def same_start(a: float, b: float) -> bool:
    """Are two readings of one process's start time (seconds since the epoch, as psutil gives them) the same start?

    The kernel keeps a process's start in clock ticks since boot; the epoch time adds the boot time, which it
    derives from the wall clock in whole seconds (/proc/stat's btime), so a clock step between two readings, in two
    processes, moves the same start by whole seconds. Another process at the same pid is told apart by the ticks:
    the fractions of a second differ, short of a start exactly a whole second away (and the command line compared
    beside it)."""
    shift = a - b
    return abs(shift) <= 2.05 and abs(shift - round(shift)) <= 0.05


def same_process(recorded: ProcessIdentity, running: ProcessIdentity | None) -> tuple[bool, str]:
    """Pure: is `running` (what the pid is now; None: no such process) the process `recorded` names?"""
    if running is None:
        return False, f"no process has pid {recorded.pid} any more"
    if not same_start(running.started_at, recorded.started_at):
        return False, (f"pid {recorded.pid} is another process now (started at {running.started_at:.2f}, "
                       f"not {recorded.started_at:.2f})")
    if running.cmdline != recorded.cmdline:
        return False, f"pid {recorded.pid} now runs {' '.join(running.cmdline)[:200]!r}"
    return True, f"pid {recorded.pid} is still the process that was recorded"


def still_running(recorded: ProcessIdentity | None, pid: int) -> tuple[bool, str]:
    """Is pid `pid` still the process `recorded` names (None: nothing was recorded, so no)?"""
    if recorded is None:
        return False, f"nothing records which process pid {pid} was (an older outlast wrote it)"
    return same_process(recorded, identify(pid))


def identify(pid: int) -> ProcessIdentity | None:
    """What pid `pid` is now, or None if it does not exist (or vanished while we looked)."""
    try:
        p = psutil.Process(pid)
        return ProcessIdentity(pid=pid, started_at=p.create_time(), cmdline=p.cmdline())
    except (psutil.NoSuchProcess, ValueError, OverflowError):  # read from a file: -1, 0 or 2**63 names no process
        return None


def host_id(root: Path = Path("/")) -> str:
    """Where a pid means the same process: this machine (machine id), this boot (boot id, random at
    every boot, so two machines cloned from one image still differ) and this pid namespace (two
    containers on one kernel share the boot id but not their pids). None of them changes while a process
    lives: read once per process (by pid, so a forked child reads its own)."""
    return _host_id(root, os.getpid())


@functools.cache
def _host_id(root: Path, pid: int) -> str:
    machine = _read(root / "etc/machine-id") or _read(root / "var/lib/dbus/machine-id") or socket.gethostname()
    boot = _read(root / "proc/sys/kernel/random/boot_id")
    try:
        pid_ns = os.readlink(root / "proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    return f"{machine}/{boot}/{pid_ns}"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
