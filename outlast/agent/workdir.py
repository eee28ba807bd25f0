"""The agent's own files ($OUTLAST_HOME/agents/<node id>/): its workers' error files.

An agent killed without a chance to clean up (SIGKILL, the kernel's OOM killer, a crash, its
container or machine gone) leaves its directory behind; the next agent to start on this
machine removes every one whose agent is gone, before it claims its own. Its cgroups are
cleaned the same way by isolation (`cleanup_stale` in outlast/isolation/cgroup_v1.py and
cgroup_v2.py).

Whether an agent is gone is told by a lock, not by its pid: each agent holds an exclusive
`flock` on its directory's `owner.lock` for as long as it lives, and the kernel lets go of it
whatever way the process ends. A pid says nothing once it is reused by another program, nor
seen from another pid namespace (a container started again) or after a reboot, and a lock
means the same thing in all of those. `owner.json` (pid, host) is kept to say who held it.
Claims take `agents/.lock` while they sweep and create, so one never removes the directory
of an agent starting in the same instant (created, its lock not yet taken).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec

from outlast.client.liveness import host_id
from outlast.procutil import pid_alive
from outlast.statedir import private_subdir

log = logging.getLogger("outlast.agent")

OWNER = "owner.json"
LOCK = "owner.lock"
CLAIMS = ".lock"

_held: dict[Path, int] = {}  # this process's directories -> the fd that holds their lock


class Owner(msgspec.Struct):
    pid: int
    host_id: str


def claim(node_id: str, root: Path | None = None) -> Path:
    """Remove what agents that are gone left, then make and return this agent's directory."""
    root = root or private_subdir("agents")
    root.mkdir(parents=True, exist_ok=True)
    with _claims_lock(root):
        for path in sorted(root.iterdir()):
            if path.name == CLAIMS or not path.is_dir():
                continue
            why = _stale(path)
            if why:
                shutil.rmtree(path, ignore_errors=True)
                _close(path)
                log.info("removed %s: %s", path, why)
        mine = root / node_id
        if mine.exists():
            raise ValueError(f"another agent with node id {node_id} runs on this machine ({_who(mine)}, "
                             f"{mine}); give this one another --node-id")
        mine.mkdir()
        fd = os.open(mine / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # free: the directory is new, and no one else claims now
        _held[mine] = fd
        (mine / OWNER).write_bytes(msgspec.json.encode(Owner(os.getpid(), host_id())))
    return mine


def release(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _close(path)


@contextlib.contextmanager
def _claims_lock(root: Path) -> Iterator[None]:
    fd = os.open(root / CLAIMS, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _close(path: Path) -> None:
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def _stale(path: Path) -> str | None:
    """Why `path` belongs to an agent that is gone, or None (alive, or not ours to judge)."""
    if path in _held:
        return None  # this process's own (an agent started twice in one process, in tests)
    try:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        # Claims create the lock under the claims lock, which we hold: none is being made now.
        return "no lock (an agent that died while it started, or of an older outlast)" \
            if not (path / OWNER).exists() else _stale_by_pid(path)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return None  # its agent holds it: alive, in whatever pid namespace or machine
    except OSError:
        return None  # a file system that cannot lock: not ours to judge
    finally:
        os.close(fd)
    return f"left by an agent that is gone ({_who(path)}; its lock was free)"


def _stale_by_pid(path: Path) -> str | None:
    """A directory of an outlast before locks: judged by its pid, on this host only."""
    owner = _owner(path)
    if owner is None or owner.host_id != host_id() or pid_alive(owner.pid):
        return None
    return f"left by an agent (pid {owner.pid}) that is gone"


def _owner(path: Path) -> Owner | None:
    try:
        return msgspec.json.decode((path / OWNER).read_bytes(), type=Owner)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _who(path: Path) -> str:
    owner = _owner(path)
    return f"pid {owner.pid} on {owner.host_id}" if owner else "owner unknown"
