"""This user's private state directory (node file, cluster key, checkpoint cache), and the checks
that keep other local users out of it.

Whoever controls the directory controls which agent this user's drivers send their code and
environment to, and which cluster key they trust: so it must be this user's, and closed to
everyone else. `$OUTLAST_HOME` names another place (tests, one home per simulated machine).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafeStateError(RuntimeError):
    """A state directory or key file that another local user could read or change."""


def default_state_dir(env: os._Environ[str] | dict[str, str] = os.environ) -> Path:
    # Not a name in /tmp: another user could create it first.
    if env.get("OUTLAST_HOME"):
        return Path(env["OUTLAST_HOME"])
    return Path(env.get("HOME") or os.path.expanduser("~")) / ".outlast"


def state_dir(env: os._Environ[str] | dict[str, str] = os.environ, uid: int | None = None) -> Path:
    """The state directory, created if missing and checked (see `private_dir`)."""
    # A directory named by $OUTLAST_HOME was chosen on purpose: others may read it (the key file
    # in it is checked on its own), but nobody else may own it or write to it.
    return private_dir(default_state_dir(env), uid, allowed_mode=0o755 if env.get("OUTLAST_HOME") else 0o700)


def private_subdir(name: str, env: os._Environ[str] | dict[str, str] = os.environ) -> Path:
    """A directory of outlast's own in the state directory (the checkpoint cache, agents/, logs/),
    0700 whatever the state directory's mode: `$OUTLAST_HOME` may be 0755 (a directory the user
    shares on purpose), and what outlast keeps in it still reaches no one else. One of ours that is
    found wider (made by an older outlast, or by hand) is tightened to 0700, not refused: it is
    outlast's alone, and nothing in it is meant for anyone else."""
    path = state_dir(env) / name
    uid = os.geteuid()
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        st = os.lstat(path)
        if st.st_uid == uid and stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, 0o700)
    return private_dir(path, uid)


def private_dir(path: Path, uid: int | None = None, allowed_mode: int = 0o700) -> Path:
    """Create `path` 0700 if missing; raise `UnsafeStateError` if someone else owns it or if group
    or others have more access than `allowed_mode` gives them. Returns `path`."""
    uid = os.geteuid() if uid is None else uid
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(path)
    problem = unsafe_because(st, uid, allowed_mode)
    if stat.S_ISLNK(st.st_mode):
        problem = "it is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "it is not a directory"
    if problem:
        raise UnsafeStateError(
            f"outlast's state directory {path} is not private: {problem}. Another local user could "
            f"redirect your runs through it. Fix: `chmod {allowed_mode:o} {path}` if it is yours, or remove it and let "
            "outlast create it, or set OUTLAST_HOME to a directory only you can use"
        )
    return path


def unsafe_because(st: os.stat_result, uid: int, allowed_mode: int) -> str | None:
    """Why a file with this stat is unsafe for user `uid`, or None. Pure."""
    if st.st_uid != uid:
        return f"it belongs to uid {st.st_uid}, not to you (uid {uid})"
    extra = stat.S_IMODE(st.st_mode) & ~allowed_mode & 0o777
    if extra:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}: group or others have access ({extra:04o})"
    return None


def check_secret_file(path: Path, uid: int | None = None) -> None:
    """Refuse a key file that someone else owns or that group or others can read (as ssh does)."""
    uid = os.geteuid() if uid is None else uid
    problem = unsafe_because(os.stat(path), uid, allowed_mode=0o600)
    if problem:
        raise UnsafeStateError(
            f"the cluster key {path} is not private: {problem}. Anyone who can read it can join the "
            f"cluster and run code on every node. Fix: `chmod 600 {path}` (and `chown` it to yourself), "
            "and if others may have read it, make a new key by restarting the cluster"
        )


def write_secret_file(path: Path, data: bytes) -> None:
    """Write `data` so that the file is 0600 whatever was there before (a new inode, renamed in)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask may only remove bits, but be explicit
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
