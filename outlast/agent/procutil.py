"""Small process helpers shared by the agent, its fork server and the workers."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` when our parent exits: no orphans, whatever kills the parent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return  # not Linux: the heartbeat timeout still reclaims the workers


def kill_tree(pid: int, sig: int) -> None:
    """Signal a worker's whole process group (it leads its own session), or the pid if it has none yet."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    except PermissionError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def decode_wait_status(status: int) -> tuple[int | None, int | None]:
    """(exit_code, signal) from a waitpid status."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status), None


def pid_alive(pid: int) -> bool:
    """Whether a process exists (one we may not signal still does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
