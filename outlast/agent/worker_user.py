"""`outlast start --worker-user USER`: workers run as another user than their agent.

The agent runs as root (it must, to change a child's user) and keeps its state directory
(cluster key, node file, error files, output files) 0700; each worker drops to USER after the
fork and before any user code, so it can read none of it, nor signal or trace the agent and
its fork server. What a worker needs of the node's is opened for it before the drop: its
output file (fd 1 and 2), its cgroup leaf (joined as root), its error file (an fd it writes
through `/proc/self/fd`). Its home is USER's: its checkpoint cache is in USER's `~/.outlast`.
"""

from __future__ import annotations

import ctypes
import os
import pwd

import msgspec

_PR_SET_DUMPABLE = 4


class WorkerUser(msgspec.Struct, frozen=True):
    name: str
    uid: int
    gid: int
    home: str


def resolve(name: str, euid: int | None = None) -> WorkerUser:
    """The user named by --worker-user; raises ValueError saying what to fix."""
    euid = os.geteuid() if euid is None else euid
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(f"--worker-user {name}: no such user on this machine; create it (useradd --create-home "
                         f"{name}) or name another") from None
    if entry.pw_uid == 0:
        raise ValueError(f"--worker-user {name}: that is root; workers must run as a user without privileges")
    if euid != 0:
        raise ValueError(f"--worker-user {name}: the agent runs as uid {euid}, and only root can start workers as "
                         "another user; start the node as root (sudo outlast start ..., or the systemd unit), or "
                         "leave --worker-user out")
    return WorkerUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid, home=entry.pw_dir)


def encode(user: WorkerUser) -> str:
    return msgspec.json.encode(user).decode()


def decode(text: str) -> WorkerUser:
    return msgspec.json.decode(text, type=WorkerUser)


def open_error_file(path: str, user: WorkerUser) -> int:
    """The worker's error file, made by root in the agent's directory and given to `user` as an fd
    (inheritable: the worker writes it through /proc/self/fd/N)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchown(fd, user.uid, user.gid)
    os.set_inheritable(fd, True)
    return fd


def drop_to(user: WorkerUser) -> None:
    """In the forked child, before user code: become `user` for good (groups, gid, then uid), with
    its home in the environment and none of the agent's state directory."""
    os.initgroups(user.name, user.gid)
    os.setgid(user.gid)
    os.setuid(user.uid)
    if os.getuid() != user.uid or os.geteuid() != user.uid:
        raise OSError(f"could not drop the worker to {user.name} (uid {user.uid})")
    # A change of user makes the process undumpable: it could not open its own /proc/self/fd, and
    # tools of USER's could not read its stacks. Nothing of root's is in its memory (the fork
    # server holds no secret), so it may be as dumpable as any process of USER's.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    os.environ.pop("OUTLAST_HOME", None)
    os.environ.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
