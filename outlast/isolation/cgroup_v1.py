"""The node's cgroup v1 subtree: the v2 layout repeated in the memory and the cpu hierarchies.

    <hierarchy>/<cgroup-path>/outlast_<node_id>/{system, user/{workers/<leaf>, non-outlast}}

`user` gets memory.limit_in_bytes = total - reserved with the kernel OOM killer disabled
(memory.oom_control = 1): at the limit its processes stall instead of dying, and outlast
chooses whom to kill. cpu.shares carry the weights. Eventfds wake the monitor.
"""

from __future__ import annotations

import os
import signal

from outlast.procutil import holds_an_agent
from outlast.faults import fault_point
from outlast.isolation.cgroup_v2 import PREFIX
from outlast.isolation.driver import MemoryReading, Unreadable
from outlast.isolation.errors import IsolationUnavailable
from outlast.isolation.journal import CgroupFS, Journal
from outlast.isolation.monitor import EventSource, V1EventFd
from outlast.isolation.reservations import Reservations
from outlast.protocol.messages import Resources

SHARES = 10240  # split between system and user; a leaf gets 1024 per requested core
UNLIMITED = 1 << 62  # v1 reports "no limit" as a huge number (9223372036854771712)


class _Hierarchy:
    def __init__(self, mount: str, cgroup_path: str, node_id: str) -> None:
        self.mount = mount
        self.base = os.path.normpath(mount + "/" + cgroup_path.strip("/"))
        self.root = os.path.join(self.base, PREFIX + node_id)
        self.system = os.path.join(self.root, "system")
        self.user = os.path.join(self.root, "user")
        self.workers = os.path.join(self.user, "workers")
        self.non_outlast = os.path.join(self.user, "non-outlast")
        self.at_root = self.base == os.path.normpath(mount)

    def dirs(self) -> tuple[str, ...]:
        return self.root, self.system, self.user, self.workers, self.non_outlast


class CgroupV1:
    version = 1

    def __init__(self, mounts: dict[str, str], cgroup_paths: dict[str, str], node_id: str,
                 fs: CgroupFS | None = None, self_pids: list[int] | None = None) -> None:
        """`mounts` and `cgroup_paths` per controller ("memory", "cpu")."""
        self.fs = fs or CgroupFS()
        self.mem = _Hierarchy(mounts["memory"], cgroup_paths["memory"], node_id)
        self.cpu = _Hierarchy(mounts["cpu"], cgroup_paths["cpu"], node_id)
        self.root = self.mem.root
        self.self_pids = self_pids if self_pids is not None else [os.getpid()]
        self.journal = Journal(self.fs)

    # ---- before any write -----------------------------------------------------------

    def validate(self) -> None:
        fs, problems = self.fs, []
        for h, probe, what in ((self.mem, "memory.limit_in_bytes", "memory"), (self.cpu, "cpu.shares", "cpu")):
            if not fs.exists(os.path.join(h.mount, probe)):
                problems.append(f"no cgroup v1 {what} hierarchy at {h.mount}; mount it "
                                f"(mount -t cgroup -o {what} none {h.mount}) or pass the right --cgroup-path")
                continue
            if not fs.exists(h.base):
                problems.append(f"the cgroup {h.base} does not exist; create it or pass an existing --cgroup-path")
                continue
            for f in ("", "cgroup.procs"):
                path = os.path.join(h.base, f) if f else h.base
                if not fs.writable(path):
                    problems.append(f"no write access to {path}; run the agent as root or as the owner of "
                                    "that cgroup, or pass a --cgroup-path it owns")
        if fs.exists(self.mem.base):
            if fs.read_int(os.path.join(self.mem.base, "memory.use_hierarchy"), 1) != 1:
                problems.append(f"{self.mem.base}/memory.use_hierarchy is 0, so a limit on user/ would not cover "
                                f"the workers below it; echo 1 > {self.mem.base}/memory.use_hierarchy before "
                                "it has children, or use another --cgroup-path")
            for f in ("memory.oom_control", "cgroup.event_control"):
                if not fs.exists(os.path.join(self.mem.base, f)):
                    problems.append(f"{self.mem.base} has no {f}; this kernel's memory controller cannot stall "
                                    "workloads at the limit or notify outlast; use cgroup v2 or a newer kernel")
        if fs.exists(self.root) and self._owner_alive(self.mem):
            problems.append(f"{self.root} belongs to a running agent; give this node another --node-id")
        if problems:
            raise IsolationUnavailable(problems)

    def starting_limit(self) -> int | None:
        limits, path = [], self.mem.base
        while path.startswith(self.mem.mount) and len(path) >= len(self.mem.mount.rstrip("/")):
            limit = self.fs.read_int(os.path.join(path, "memory.limit_in_bytes"))
            if limit is not None and limit < UNLIMITED:
                limits.append(limit)
            if path == self.mem.mount.rstrip("/"):
                break
            path = os.path.dirname(path)
        return min(limits) if limits else None

    # ---- set-up and undo ---------------------------------------------------------------

    def setup(self, res: Reservations) -> None:
        j, fs = self.journal, self.fs
        for h in (self.mem, self.cpu):
            for path in h.dirs():
                j.mkdir(path)
            # v1 has no rule against processes beside child cgroups, so nothing has to leave the
            # base; below the root, its processes share the node and go under user/ (and back
            # on stop). At the root they are the whole machine (init, kernel threads): untouched.
            if not h.at_root:
                foreign = [p for p in fs.pids(h.base) if p not in self.self_pids]
                j.move(foreign, h.base, h.non_outlast)
            j.move(self.self_pids, h.base, h.system)
        fault_point("isolation.setup.mid")
        j.set_value(os.path.join(self.mem.user, "memory.limit_in_bytes"), str(res.user_memory))
        # Stall, don't kill: outlast's monitor picks the victims by its policy.
        j.write(os.path.join(self.mem.user, "memory.oom_control"), "1", "0")
        # v1 has no memory.low; the soft limit is the nearest protection for the system under pressure.
        j.set_value(os.path.join(self.mem.system, "memory.soft_limit_in_bytes"), str(res.system_memory))
        w_sys = res.system_weight(SHARES)
        j.set_value(os.path.join(self.cpu.system, "cpu.shares"), str(w_sys))
        j.set_value(os.path.join(self.cpu.user, "cpu.shares"), str(SHARES - w_sys))

    def teardown(self) -> list[str]:
        return self.journal.undo()

    # ---- what a crashed agent left ---------------------------------------------------------

    def _owner_alive(self, h: _Hierarchy, tree: str | None = None) -> bool:
        tree = tree or h.root
        return holds_an_agent(self.fs.pids(os.path.join(tree, "system")))

    def cleanup_stale(self) -> list[str]:
        done = []
        for h in (self.mem, self.cpu):
            for leaf in self.fs.listdir(h.workers):  # left by this node's agent when it was killed
                path = os.path.join(h.workers, leaf)
                _kill_all(self.fs, path)
                left = self.fs.remove_tree(path)
                done.append(f"removed the worker leaf {path} left by this node's last agent" +
                            (f" (could not remove {', '.join(left)})" if left else ""))
            for name in self.fs.listdir(h.base):
                tree = os.path.join(h.base, name)
                if not name.startswith(PREFIX) or tree == h.root or self._owner_alive(h, tree):
                    continue
                workers = os.path.join(tree, "user", "workers")
                for leaf in self.fs.listdir(workers):
                    _kill_all(self.fs, os.path.join(workers, leaf))
                # Its other processes share this node now, or at a hierarchy's root go back to it.
                home = h.non_outlast if self.fs.exists(h.non_outlast) and not h.at_root else h.base
                for sub in ("system", "user/non-outlast"):
                    for pid in self.fs.pids(os.path.join(tree, sub)):
                        self.fs.move(pid, home)
                left = self.fs.remove_tree(tree)
                done.append(f"removed {tree} left by an agent that is gone" +
                            (f" (could not remove {', '.join(left)})" if left else ""))
        return done

    # ---- worker leaves -------------------------------------------------------------------

    def create_leaf(self, name: str, resources: Resources) -> list[str]:
        mem, cpu = os.path.join(self.mem.workers, name), os.path.join(self.cpu.workers, name)
        self.fs.mkdir(mem)
        self.fs.mkdir(cpu)
        self.fs.write(os.path.join(cpu, "cpu.shares"), str(max(round(1024 * resources.num_cpus), 2)))
        return [os.path.join(mem, "cgroup.procs"), os.path.join(cpu, "cgroup.procs")]

    def kill_leaf(self, name: str) -> None:
        _kill_all(self.fs, os.path.join(self.mem.workers, name))

    def leaf_pids(self, name: str) -> list[int]:
        return self.fs.pids(os.path.join(self.mem.workers, name))

    def remove_leaf(self, name: str) -> bool:
        left = self.fs.remove_tree(os.path.join(self.mem.workers, name), timeout_s=0.0)
        left += self.fs.remove_tree(os.path.join(self.cpu.workers, name), timeout_s=0.0)
        return not left

    def leaf_memory(self, name: str) -> int:
        stat = self.fs.stat(os.path.join(self.mem.workers, name))
        return stat.get("total_rss", 0) + stat.get("total_shmem", 0)

    # ---- memory ----------------------------------------------------------------------------

    def sample(self) -> MemoryReading | Unreadable:
        try:
            user_stat, root_stat = self.fs.read_stat(self.mem.user), self.fs.read_stat(self.mem.root)
        except OSError as e:
            return {"unreadable": f"cannot read memory.stat under {self.mem.root}: {e}"}
        limit = self.fs.read_int(os.path.join(self.mem.user, "memory.limit_in_bytes"))
        oom = self._oom_control(self.mem.user)
        return {
            "limit": None if limit is None or limit >= UNLIMITED else limit,
            "counted": user_stat.get("total_rss", 0) + root_stat.get("total_shmem", 0),
            "user": self.fs.read_int(os.path.join(self.mem.user, "memory.usage_in_bytes"), 0),
            "system": self.fs.read_int(os.path.join(self.mem.system, "memory.usage_in_bytes"), 0),
            "stalled": oom.get("under_oom", 0) == 1,
            "kernel_oom_kills": self.kernel_oom_kills(),
        }

    def release_to_kernel(self) -> str | None:
        """user/ is stalled at its limit and holds no outlast worker to kill: let the kernel's OOM
        killer act there again (until `hold_from_kernel`). Returns what was done, or None."""
        path = os.path.join(self.mem.user, "memory.oom_control")
        if self._oom_control(self.mem.user).get("oom_kill_disable", 1) == 0:
            return None
        self.fs.write(path, "0")
        return (f"{self.mem.user} is at its memory limit and holds no outlast worker to kill (only other "
                "processes); handed it back to the kernel's OOM killer until outlast has workers there again")

    def hold_from_kernel(self) -> None:
        """Workers are back: outlast chooses the victims again."""
        if self._oom_control(self.mem.user).get("oom_kill_disable", 0) == 0:
            self.fs.write(os.path.join(self.mem.user, "memory.oom_control"), "1")

    def _oom_control(self, path: str) -> dict[str, int]:
        try:
            text = self.fs.read(os.path.join(path, "memory.oom_control"))
        except OSError:
            return {}
        return {k: int(v) for k, v in (line.split() for line in text.splitlines() if line.strip())}

    def kernel_oom_kills(self) -> int:
        # The counter is per cgroup (not hierarchical): add up the whole tree.
        total, stack = 0, [self.mem.root]
        while stack:
            path = stack.pop()
            total += self._oom_control(path).get("oom_kill", 0)
            stack += [os.path.join(path, c) for c in self.fs.listdir(path)]
        return total

    def monitors(self, limit: int | None, kill_at: float = 0.95) -> list[EventSource]:
        sources: list[EventSource] = [V1EventFd(self.mem.user, "memory.oom_control", "", "memory.oom_control")]
        if not limit:
            return sources
        for fraction in (0.9, kill_at):
            # usage_in_bytes also counts page cache; an event only wakes the monitor, which then
            # judges by anon and shared memory. The second one fires at the kill threshold, so
            # outlast acts before the cgroup stalls at its limit.
            threshold = int(limit * fraction)
            sources.append(V1EventFd(self.mem.user, "memory.usage_in_bytes", str(threshold),
                                     f"memory.usage_in_bytes threshold {threshold}"))
        return sources


def _kill_all(fs: CgroupFS, path: str) -> None:
    """v1 has no cgroup.kill: signal every pid, again until none is left (a fork may race us)."""
    for _ in range(5):
        pids = fs.pids(path)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
