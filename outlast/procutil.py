"""Small process helpers shared by the agent, its fork server, the workers and isolation.

The bottom layer (docs/architecture.md): it imports nothing of outlast.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import traceback

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` when our parent exits: no orphans, whatever kills the parent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return  # not Linux: the heartbeat timeout still reclaims the workers


def become_subreaper() -> bool:
    """Adopt the orphans among our descendants (PR_SET_CHILD_SUBREAPER): a process that a child of
    ours started and left behind becomes our child, not init's, so we can still end it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        result: int = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        return result == 0
    except (OSError, AttributeError):
        return False


def own_children() -> set[int]:
    """The pids whose parent is this process (single-threaded: its main thread's children)."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        pass
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.add(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return found


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


FORK_SERVER_MODULE = "outlast.agent.zygote"  # what forkserver.py runs, and what marks its processes


def is_fork_server(pid: int) -> bool:
    """Whether `pid` runs outlast's fork server (or is a worker it forked and has not yet moved)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return FORK_SERVER_MODULE.encode() in f.read().split(b"\0")
    except OSError:
        return False


def holds_an_agent(pids: list[int]) -> bool:
    """Whether a tree's system/ processes (`pids`) include a live agent. A killed agent's fork servers
    outlive it by the moment they take to end its workers (they get SIGTERM when it dies), and must not
    make its tree look owned: the next agent would refuse or keep a tree that nobody runs."""
    return any(pid_alive(p) and not is_fork_server(p) for p in pids)


def user_traceback(exc: BaseException, runtime_file: str) -> str:
    """The traceback from the user's code down: the frames of `runtime_file` above it are noise."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == runtime_file:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def become_clean_process(env: dict[str, str], cwd: str, sys_path: list[str]) -> None:
    """Leave the fork server behind: own session, default signals, `env` as the whole environment
    (`runenv.worker_env`: the node's own with what the run carries)."""
    if os.getsid(0) != os.getpid():  # the fork server may have made it a session leader already
        os.setsid()
    die_with_parent()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    try:
        os.chdir(cwd)
    except OSError:
        pass
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
