"""The node's cgroup v2 subtree (docs/architecture.md, section 5):

    <cgroup-path>/outlast_<node_id>/    +cpu +memory for children
        system/      the agent and its fork server   memory.low, cpu.weight = W_sys
        user/        every workload                   memory.high, cpu.weight = 10000 - W_sys
            workers/<leaf>                            one per worker, killed whole (cgroup.kill)
            non-outlast/                              processes found in <cgroup-path> at start
"""

from __future__ import annotations

import os
import signal

from outlast.faults import fault_point
from outlast.isolation.driver import MemoryReading, Unreadable
from outlast.isolation.errors import IsolationUnavailable
from outlast.isolation.journal import CgroupFS, Journal
from outlast.isolation.monitor import EventSource, Inotify, PsiTrigger
from outlast.isolation.reservations import Reservations
from outlast.protocol.messages import Resources
from outlast.procutil import holds_an_agent

CONTROLLERS = ("cpu", "memory")
PREFIX = "outlast_"
# Some pressure for 150 ms in any 1 s window: early enough to act before workloads stall long.
PSI_TRIGGER = "some 150000 1000000"


class CgroupV2:
    version = 2

    def __init__(self, mount: str, cgroup_path: str, node_id: str, fs: CgroupFS | None = None,
                 self_pids: list[int] | None = None) -> None:
        self.fs = fs or CgroupFS()
        self.mount = mount
        self.cgroup_path = "/" + cgroup_path.strip("/")
        self.base = os.path.normpath(mount + self.cgroup_path)
        self.root = os.path.join(self.base, PREFIX + node_id)
        self.system = os.path.join(self.root, "system")
        self.user = os.path.join(self.root, "user")
        self.workers = os.path.join(self.user, "workers")
        self.non_outlast = os.path.join(self.user, "non-outlast")
        self.self_pids = self_pids if self_pids is not None else [os.getpid()]
        self.journal = Journal(self.fs)

    # ---- before any write -----------------------------------------------------------

    def validate(self) -> None:
        fs, problems = self.fs, []
        if not fs.exists(os.path.join(self.mount, "cgroup.controllers")):
            raise IsolationUnavailable([
                f"{self.mount} is not a cgroup v2 mount; mount it (mount -t cgroup2 none {self.mount}) "
                "or use a host with the unified hierarchy"])
        if not fs.exists(self.base):
            raise IsolationUnavailable([f"the cgroup {self.base} does not exist; pass an existing one as "
                                        "--cgroup-path, or start outlast inside the cgroup it should manage"])
        try:
            available = fs.read(os.path.join(self.base, "cgroup.controllers")).split()
        except OSError as e:
            available = []
            problems.append(f"cannot read {self.base}/cgroup.controllers: {e}")
        for c in CONTROLLERS:
            if c not in available:
                problems.append(
                    f"the {c} controller is not available in {self.base} (it has: {' '.join(available) or 'none'}); "
                    f"enable it in the parent's cgroup.subtree_control (echo +{c} > "
                    f"{os.path.dirname(self.base)}/cgroup.subtree_control), or for a systemd service set Delegate=yes")
        for f in ("", "cgroup.procs", "cgroup.subtree_control"):
            path = os.path.join(self.base, f) if f else self.base
            if fs.exists(path) and not fs.writable(path):
                problems.append(f"no write access to {path}; run the agent as the owner of the delegated "
                                "cgroup (e.g. systemd Delegate=yes) or pass a --cgroup-path it owns")
        if fs.exists(self.root) and self._owner_alive(self.root):
            problems.append(f"{self.root} belongs to a running agent; give this node another --node-id")
        if problems:
            raise IsolationUnavailable(problems)

    def starting_limit(self) -> int | None:
        """The smallest memory.max on the way from <cgroup-path> up to the mount."""
        limits, path = [], self.base
        while path.startswith(self.mount) and len(path) > len(self.mount.rstrip("/")):
            limit = self.fs.read_int(os.path.join(path, "memory.max"))
            if limit is not None:
                limits.append(limit)
            path = os.path.dirname(path)
        return min(limits) if limits else None

    # ---- set-up and undo ---------------------------------------------------------------

    def setup(self, res: Reservations) -> None:
        j, fs = self.journal, self.fs
        for path in (self.root, self.system, self.user, self.workers, self.non_outlast):
            j.mkdir(path)
        # The kernel's rule: a cgroup that hands controllers to children holds no processes,
        # so whatever lives in <cgroup-path> moves down first (the root cgroup is exempt).
        if self.cgroup_path != "/":
            foreign = [p for p in fs.pids(self.base) if p not in self.self_pids]
            j.move(foreign, self.base, self.non_outlast)
        for pid in self.self_pids:
            # Back where it came from on undo: <cgroup-path> itself, or a leaf below it that
            # launched us (the only kind of place v2 lets a process sit next to delegated children).
            origin = fs.v2_cgroup_of(pid, self.mount)
            if origin is None or not (origin == self.base or origin.startswith(self.base + "/")) \
                    or origin.startswith(self.root) or not fs.exists(origin):
                origin = self.base
            j.move([pid], origin, self.system)
        fault_point("isolation.setup.mid")
        # Top-down: a controller can be handed on only once the parent has it.
        for path in (self.base, self.root, self.user, self.workers):
            self._enable(path)
        w_sys = res.system_weight(10000)
        j.set_value(os.path.join(self.system, "memory.low"), str(res.system_memory))
        j.set_value(os.path.join(self.system, "cpu.weight"), str(w_sys))
        j.set_value(os.path.join(self.user, "memory.high"), str(res.user_memory))
        j.set_value(os.path.join(self.user, "cpu.weight"), str(10000 - w_sys))

    def _enable(self, path: str) -> None:
        control = os.path.join(path, "cgroup.subtree_control")
        have = self.fs.read(control).split()
        missing = [c for c in CONTROLLERS if c not in have]
        if missing:
            self.journal.write(control, " ".join(f"+{c}" for c in missing), " ".join(f"-{c}" for c in missing))

    def teardown(self) -> list[str]:
        return self.journal.undo()

    # ---- what a crashed agent left ---------------------------------------------------------

    def _owner_alive(self, tree: str) -> bool:
        return holds_an_agent(self.fs.pids(os.path.join(tree, "system")))

    def cleanup_stale(self) -> list[str]:
        """Trees of agents that died without undoing: kill their workers, keep other processes, remove."""
        done = []
        for leaf in self.fs.listdir(self.workers):  # left by this node's agent when it was killed
            path = os.path.join(self.workers, leaf)
            self._kill(path)
            left = self.fs.remove_tree(path)
            done.append(f"removed the worker leaf {path} left by this node's last agent" +
                        (f" (could not remove {', '.join(left)})" if left else ""))
        for name in self.fs.listdir(self.base):
            tree = os.path.join(self.base, name)
            if not name.startswith(PREFIX) or tree == self.root or self._owner_alive(tree):
                continue
            workers = os.path.join(tree, "user", "workers")
            for leaf in self.fs.listdir(workers):
                self._kill(os.path.join(workers, leaf))
            # Other processes (found there at its start) go on living in our own non-outlast.
            for sub in ("system", "user/non-outlast"):
                for pid in self.fs.pids(os.path.join(tree, sub)):
                    if self.fs.exists(self.non_outlast):
                        self.journal.move([pid], self.base, self.non_outlast)
            left = self.fs.remove_tree(tree)
            done.append(f"removed {tree} left by an agent that is gone" +
                        (f" (could not remove {', '.join(left)})" if left else ""))
        return done

    # ---- worker leaves -------------------------------------------------------------------

    def leaf(self, name: str) -> str:
        return os.path.join(self.workers, name)

    def create_leaf(self, name: str, resources: Resources) -> list[str]:
        path = self.leaf(name)
        self.fs.mkdir(path)
        weight = min(max(round(100 * resources.num_cpus), 1), 10000)
        self.fs.write(os.path.join(path, "cpu.weight"), str(weight))
        # If the kernel ever has to act inside a leaf, it takes the whole worker, never half of it.
        if self.fs.exists(os.path.join(path, "memory.oom.group")):
            self.fs.write(os.path.join(path, "memory.oom.group"), "1")
        return [os.path.join(path, "cgroup.procs")]

    def kill_leaf(self, name: str) -> None:
        self._kill(self.leaf(name))

    def _kill(self, path: str) -> None:
        kill_file = os.path.join(path, "cgroup.kill")
        if self.fs.exists(kill_file):
            try:
                self.fs.write(kill_file, "1")
                return
            except OSError:
                pass
        for pid in self.fs.pids(path):
            _sigkill(pid)

    def leaf_pids(self, name: str) -> list[int]:
        return self.fs.pids(self.leaf(name))

    def remove_leaf(self, name: str) -> bool:
        return not self.fs.remove_tree(self.leaf(name), timeout_s=0.0)

    def leaf_memory(self, name: str) -> int:
        stat = self.fs.stat(self.leaf(name))
        if stat:
            return stat.get("anon", 0) + stat.get("shmem", 0)
        return self.fs.read_int(os.path.join(self.leaf(name), "memory.current"), 0) or 0

    # ---- memory ----------------------------------------------------------------------------

    def sample(self) -> MemoryReading | Unreadable:
        try:
            user_stat, root_stat = self.fs.read_stat(self.user), self.fs.read_stat(self.root)
        except OSError as e:
            return {"unreadable": f"cannot read memory.stat under {self.root}: {e}"}
        return {
            "limit": self.fs.read_int(os.path.join(self.user, "memory.high")),
            # Shared memory is charged to whoever touched it first, system or user: count all of it.
            "counted": user_stat.get("anon", 0) + root_stat.get("shmem", 0),
            "user": self.fs.read_int(os.path.join(self.user, "memory.current"), 0),
            "system": self.fs.read_int(os.path.join(self.system, "memory.current"), 0),
            "stalled": False,
            "kernel_oom_kills": self.kernel_oom_kills(),
        }

    def kernel_oom_kills(self) -> int:
        try:
            text = self.fs.read(os.path.join(self.root, "memory.events"))
        except OSError:
            return 0
        counts = dict(line.split() for line in text.splitlines() if line.strip())
        return int(counts.get("oom_kill", 0))

    def monitors(self, limit: int | None, kill_at: float = 0.95) -> list[EventSource]:
        sources: list[EventSource] = [Inotify(os.path.join(self.user, "memory.events"), "memory.events (high)")]
        try:
            sources.append(PsiTrigger(os.path.join(self.user, "memory.pressure"), PSI_TRIGGER,
                                      f"PSI memory.pressure '{PSI_TRIGGER}'"))
        except OSError:
            pass  # a kernel without PSI: the high counter and the threshold monitor still cover it
        return sources


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
