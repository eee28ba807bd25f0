"""File access to a cgroup tree, and the journal of every change so stop undoes it in reverse order.

`CgroupFS` is the one place that touches cgroup files; unit tests pass a fake that acts like
the kernel on a temporary directory (interface files appear on mkdir, moves are exclusive).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger("outlast.isolation")


class CgroupFS:
    """The real cgroup file system."""

    def read(self, path: str) -> str:
        with open(path) as f:
            return f.read().strip()

    def write(self, path: str, value: str) -> None:
        # One write() per value: cgroup files act on each write call.
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    def mkdir(self, path: str) -> None:
        os.mkdir(path)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def writable(self, path: str) -> bool:
        return os.access(path, os.W_OK)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(e for e in os.listdir(path) if os.path.isdir(os.path.join(path, e)))
        except FileNotFoundError:
            return []

    # ---- helpers on top of the primitives ----------------------------------------

    def pids(self, cgroup_dir: str) -> list[int]:
        try:
            return [int(x) for x in self.read(os.path.join(cgroup_dir, "cgroup.procs")).split()]
        except (FileNotFoundError, ValueError):
            return []

    def move(self, pid: int, cgroup_dir: str) -> bool:
        """Move a process; False if it is gone already or the kernel will not move it."""
        return self.try_move(pid, cgroup_dir) == "moved"

    def try_move(self, pid: int, cgroup_dir: str) -> str:
        """"moved", "gone" (it exited), or "refused": EINVAL, which the kernel answers for a
        kernel thread, or for a real-time task a v1 cpu cgroup without an RT budget cannot take."""
        try:
            self.write(os.path.join(cgroup_dir, "cgroup.procs"), str(pid))
            return "moved"
        except ProcessLookupError:
            return "gone"
        except OSError as e:
            if e.errno == errno.ESRCH:
                return "gone"
            if e.errno == errno.EINVAL:
                return "refused"
            raise

    def v2_cgroup_of(self, pid: int, mount: str) -> str | None:
        """The directory of a process's cgroup v2, or None if it cannot be read."""
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                for line in f:
                    if line.startswith("0::"):
                        return os.path.normpath(mount + "/" + line[3:].strip())
        except OSError:
            pass
        return None

    def stat(self, cgroup_dir: str) -> dict[str, int]:
        """memory.stat as a dict; empty if unreadable (a worker's leaf that is gone)."""
        try:
            return self.read_stat(cgroup_dir)
        except OSError:
            return {}

    def read_stat(self, cgroup_dir: str) -> dict[str, int]:
        """memory.stat as a dict; raises OSError when it cannot be read."""
        out = {}
        for line in self.read(os.path.join(cgroup_dir, "memory.stat")).splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
        return out

    def read_int(self, path: str, default: int | None = None) -> int | None:
        try:
            text = self.read(path)
        except OSError:
            return default
        if text == "max":
            return None
        try:
            return int(text.split()[0])
        except (ValueError, IndexError):
            return default

    def rmdir_when_empty(self, path: str, timeout_s: float = 2.0) -> bool:
        """rmdir a cgroup, waiting (bounded) for its last processes: an exit is not instant."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.rmdir(path)
                return True
            except FileNotFoundError:
                return True
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                    return False
                time.sleep(0.02)

    def remove_tree(self, path: str, timeout_s: float = 2.0) -> list[str]:
        """rmdir a subtree bottom-up; returns what could not be removed."""
        left = []
        for child in self.listdir(path):
            left += self.remove_tree(os.path.join(path, child), timeout_s)
        if self.exists(path) and not self.rmdir_when_empty(path, timeout_s):
            left.append(path)
        return left


# One step of setup, as undo needs it: ("mkdir", path), ("write", path, the value to put back),
# ("move", pids, the cgroup they came from)
Entry = tuple[Literal["mkdir"], str] | tuple[Literal["write"], str, str] | tuple[Literal["move"], list[int], str]


@dataclass
class Journal:
    """What setup did, newest last. `undo()` walks it backwards and keeps going past errors."""

    fs: CgroupFS
    entries: list[Entry] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)  # processes the kernel would not move

    def mkdir(self, path: str) -> None:
        """Create a cgroup, or take over one this node's agent left when it was killed (setup has
        checked that no live agent owns it): either way it is ours to remove on undo."""
        try:
            self.fs.mkdir(path)
        except FileExistsError:
            pass
        self.entries.append(("mkdir", path))

    def write(self, path: str, value: str, undo: str | None) -> None:
        self.fs.write(path, value)
        if undo is not None:
            self.entries.append(("write", path, undo))

    def set_value(self, path: str, value: str) -> None:
        """Write a value, remembering the old one."""
        old = self.fs.read(path)
        self.write(path, value, old.split()[0] if old else None)

    def move(self, pids: list[int], src: str, dst: str) -> None:
        outcomes = {p: self.fs.try_move(p, dst) for p in pids}
        moved = [p for p, o in outcomes.items() if o == "moved"]
        if moved:
            self.entries.append(("move", moved, src))
        refused = [p for p, o in outcomes.items() if o == "refused"]
        if refused:
            self.refused += refused
            log.info("left %d process%s in %s: the kernel will not move %s (kernel threads, or real-time tasks a "
                     "v1 cpu cgroup cannot take): pids %s", len(refused), "" if len(refused) == 1 else "es", src,
                     "it" if len(refused) == 1 else "them", " ".join(map(str, refused[:20])) +
                     (" ..." if len(refused) > 20 else ""))

    def undo(self) -> list[str]:
        errors = []
        for entry in reversed(self.entries):
            try:
                if entry[0] == "mkdir":
                    left = self.fs.remove_tree(entry[1])
                    if left:
                        errors.append(f"could not remove {', '.join(left)}: processes are still in it")
                elif entry[0] == "write":
                    self.fs.write(entry[1], entry[2])
                elif entry[0] == "move":
                    for pid in entry[1]:
                        self.fs.move(pid, entry[2])
            except OSError as e:
                errors.append(f"undo of {entry[0]} {entry[1]}: {e}")
        self.entries.clear()
        return errors
