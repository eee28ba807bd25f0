"""Named fault points, for tests that crash a process at each step of a protocol.

`OUTLAST_FAULT_POINTS="commit.after_manifest=kill,upload.mid=raise"` makes the process
that reaches a named point kill itself with SIGKILL (or raise); `drop` tells the caller to
leave out the message it was about to send, as if it were lost. In a worker a point
fires in the first attempt only, so the restarted run can show what survived.
Unset, a fault point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

_POINTS: dict[str, str] | None = None


class InjectedFault(RuntimeError):
    pass


def _points() -> dict[str, str]:
    global _POINTS
    if _POINTS is None:
        spec = os.environ.get("OUTLAST_FAULT_POINTS", "")
        _POINTS = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
    return _POINTS


def fault_point(name: str) -> bool:
    """True when the action is `drop`: the caller leaves out what it was about to send."""
    action = _points().get(name)
    if action is None or os.environ.get("OUTLAST_ATTEMPT", "1") != "1":
        return False
    if action == "drop":
        return True
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"injected fault at {name}")


def reset() -> None:
    """Re-read the environment (a forked worker's differs from its fork server's)."""
    global _POINTS
    _POINTS = None
