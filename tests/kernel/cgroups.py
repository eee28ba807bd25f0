"""Test cgroups for the real-kernel tier: created under the test process's own cgroups, removed after.

A test never writes to a cgroup it did not create: it makes `outlast-test-<id>` below its
own cgroup (in each v1 hierarchy, or in the v2 tree), starts a node agent inside it, and
removes the whole subtree at the end.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid

from outlast.isolation.detect import own_cgroup_dirs
from outlast.isolation.journal import CgroupFS


def cgroup_version() -> int | None:
    try:
        mounts = open("/proc/self/mounts").read()
    except OSError:
        return None
    if any(line.split()[2] == "cgroup" and "memory" in line.split()[3].split(",") for line in mounts.splitlines()):
        return 1
    if any(line.split()[2] == "cgroup2" for line in mounts.splitlines()):
        return 2
    return None


def kernel_oom_kills() -> int:
    """The machine's count of kernel OOM kills (/proc/vmstat oom_kill)."""
    for line in open("/proc/vmstat"):
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


class ScratchCgroup:
    """`outlast-test-<id>` under each of this process's cgroups (v1: memory and cpu; v2: one)."""

    def __init__(self, memory_limit: int) -> None:
        self.fs = CgroupFS()
        self.name = "outlast-test-" + uuid.uuid4().hex[:8]
        self.version = cgroup_version()
        self.dirs = [os.path.join(d, self.name) for d in own_cgroup_dirs()]
        if self.version == 2:
            parent = os.path.dirname(self.dirs[0])
            have = self.fs.read(os.path.join(parent, "cgroup.subtree_control")).split()
            if "memory" not in have or "cpu" not in have:
                raise RuntimeError(f"{parent} does not hand memory and cpu to its children; the v2 test tier "
                                   "runs the tests in a cgroup that does (tests/kernel/run_v2_guest.sh)")
        for d in self.dirs:
            os.mkdir(d)
        mem = self.dirs[0]
        self.fs.write(os.path.join(mem, "memory.limit_in_bytes" if self.version == 1 else "memory.max"),
                      str(memory_limit))
        self.memory_dir = mem

        self._launches = 0

    def agent_args(self) -> list[str]:
        """v2: name the test cgroup explicitly (the agent starts in a leaf below it, see `launcher`)."""
        if self.version == 2:
            return ["--cgroup-path", self.memory_dir]
        return []

    def launcher(self):
        """A preexec_fn that moves the child into the test cgroup (v1) or a fresh leaf in it (v2).

        On v2 a cgroup that hands controllers to children holds no processes, and the test
        cgroup does once an agent ran in it; a leaf of its own always accepts the child.
        """
        targets = self.dirs
        if self.version == 2:
            self._launches += 1
            leaf = os.path.join(self.memory_dir, f"launch-{self._launches}")
            os.mkdir(leaf)
            targets = [leaf]

        def enter() -> None:
            for d in targets:
                with open(os.path.join(d, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))

        return enter

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(50):
                pids = _all_pids(self.fs, d)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.05)
            self.fs.remove_tree(d)


def _all_pids(fs: CgroupFS, path: str) -> list[int]:
    pids = fs.pids(path)
    for child in fs.listdir(path):
        pids += _all_pids(fs, os.path.join(path, child))
    return pids


def start_agent(cg: ScratchCgroup, node_id: str, args: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    """A node agent inside the test cgroup; returns it with its address once it listens."""
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "outlast.agent", "--ready-fd", str(w), "--node-id", node_id, *cg.agent_args(),
           *args]
    out = open(log_path, "ab")
    try:
        proc = subprocess.Popen(cmd, pass_fds=[w], start_new_session=True, stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, preexec_fn=cg.launcher())
    finally:
        os.close(w)
        out.close()
    try:
        buf = b""
        deadline = time.monotonic() + 60
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                proc.kill()
                raise RuntimeError(f"the agent did not start; see {log_path}:\n{open(log_path).read()[-3000:]}")
            chunk = os.read(r, 256)
            if not chunk:
                proc.wait()
                raise RuntimeError(f"the agent exited with {proc.returncode}; see {log_path}:\n"
                                   f"{open(log_path).read()[-3000:]}")
            buf += chunk
    finally:
        os.close(r)
    return proc, buf.decode().strip()
