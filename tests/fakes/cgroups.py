"""A cgroup tree in a temporary directory that acts enough like the kernel for the drivers' tests.

Interface files appear on mkdir (with the kernel's defaults), a pid written to cgroup.procs
leaves every other cgroup, rmdir refuses a cgroup with processes, and a knob makes a chosen
write fail, to test that set-up stops cleanly and undoes what it did.
"""

from __future__ import annotations

import errno
import os

from outlast.isolation.journal import CgroupFS

V2_FILES = {
    "cgroup.procs": "", "cgroup.controllers": "cpu memory io pids", "cgroup.subtree_control": "",
    "cgroup.kill": "", "memory.high": "max", "memory.low": "0", "memory.max": "max", "memory.current": "0",
    "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0", "memory.stat": "anon 0\nshmem 0",
    "memory.pressure": "", "memory.oom.group": "0", "cpu.weight": "100",
}
V1_MEMORY_FILES = {
    "cgroup.procs": "", "memory.limit_in_bytes": "9223372036854771712", "memory.use_hierarchy": "1",
    "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0", "cgroup.event_control": "",
    "memory.usage_in_bytes": "0", "memory.soft_limit_in_bytes": "9223372036854771712",
    "memory.stat": "total_rss 0\ntotal_shmem 0",
}
V1_CPU_FILES = {"cgroup.procs": "", "cpu.shares": "1024"}


class FakeCgroupFS(CgroupFS):
    def __init__(self, files_for) -> None:
        """`files_for(path)` -> the interface files a new cgroup at `path` gets."""
        self.files_for = files_for
        self.fail_write: str | None = None  # a path suffix whose next write raises EACCES
        self.unmovable: set[int] = set()  # pids a move refuses with EINVAL, as kernel threads
        self.writes: list[tuple[str, str]] = []

    def make(self, path: str, procs: list[int] | None = None, **values: str) -> None:
        os.makedirs(path, exist_ok=True)
        for name, value in self.files_for(path).items():
            with open(os.path.join(path, name), "w") as f:
                f.write(value)
        if procs:
            self._put(os.path.join(path, "cgroup.procs"), "\n".join(map(str, procs)))
        for name, value in values.items():
            self._put(os.path.join(path, name.replace("__", ".")), value)

    def _put(self, path: str, value: str) -> None:
        with open(path, "w") as f:
            f.write(value)

    def write(self, path: str, value: str) -> None:
        if self.fail_write and path.endswith(self.fail_write):
            self.fail_write = None
            raise PermissionError(errno.EACCES, "permission denied (fault injected)", path)
        self.writes.append((path, value))
        name = os.path.basename(path)
        if name == "cgroup.procs" and int(value) in self.unmovable:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        if name == "cgroup.procs":
            pid = value.strip()
            for dirpath, _, files in os.walk(self._top(path)):
                if "cgroup.procs" in files:
                    procs_path = os.path.join(dirpath, "cgroup.procs")
                    kept = [p for p in self.read(procs_path).split() if p != pid]
                    self._put(procs_path, "\n".join(kept))
            self._put(path, "\n".join(self.read(path).split() + [pid]))
        elif name == "cgroup.subtree_control":
            have = self.read(path).split()
            for token in value.split():
                c = token[1:]
                if token[0] == "+" and c not in have:
                    have.append(c)
                elif token[0] == "-" and c in have:
                    have.remove(c)
            self._put(path, " ".join(have))
        elif name == "cgroup.kill":
            self._put(os.path.join(os.path.dirname(path), "cgroup.procs"), "")
        else:
            self._put(path, value)

    def _top(self, path: str) -> str:
        # The tree's top: the directory that holds the whole fake hierarchy.
        parts = path.split(os.sep)
        return os.sep.join(parts[: parts.index("fakecg") + 2]) if "fakecg" in parts else os.path.dirname(path)

    def v2_cgroup_of(self, pid: int, mount: str) -> str | None:
        return None  # fake pids have no /proc entry: the driver falls back to <cgroup-path>

    def mkdir(self, path: str) -> None:
        os.mkdir(path)
        self.make(path)

    def rmdir(self, path: str) -> None:
        if self.pids(path):
            raise OSError(errno.EBUSY, "cgroup has processes", path)
        for sub in os.listdir(path):
            if os.path.isdir(os.path.join(path, sub)):
                raise OSError(errno.EBUSY, "cgroup has children", path)
        for f in os.listdir(path):
            os.unlink(os.path.join(path, f))
        os.rmdir(path)


def v2_tree(tmp_path) -> tuple[FakeCgroupFS, str]:
    mount = str(tmp_path / "fakecg" / "unified")
    fs = FakeCgroupFS(lambda p: dict(V2_FILES))
    fs.make(mount)
    return fs, mount


def v1_tree(tmp_path) -> tuple[FakeCgroupFS, dict[str, str]]:
    mounts = {"memory": str(tmp_path / "fakecg" / "memory"), "cpu": str(tmp_path / "fakecg" / "cpu")}
    fs = FakeCgroupFS(lambda p: dict(V1_MEMORY_FILES if "/fakecg/memory" in p else V1_CPU_FILES))
    fs.make(mounts["memory"])
    fs.make(mounts["cpu"])
    return fs, mounts
