"""Process helpers shared by the integration tests."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil


def alive(pid: int) -> bool:
    """A zombie counts as dead: its parent just has not reaped it yet."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def live_descendants_running(root: psutil.Process, marker: str) -> list[psutil.Process]:
    """`root`'s live descendants whose command line holds `marker`; one that ends (or is a zombie)
    while they are read is not among them."""
    found = []
    for p in root.children(recursive=True):
        try:
            if marker in " ".join(p.cmdline()) and alive(p.pid):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
