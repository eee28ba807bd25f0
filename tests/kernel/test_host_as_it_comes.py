"""`outlast start --enable-resource-isolation` on a host as these machines come: cgroup v1 with the
`cpu` hierarchy at its root, holding every process of the machine (init, kernel threads, other
users' work). It starts, confines its workers, leaves every other process where it was, and
stops leaving nothing behind.

The test moves nothing it did not start: memory is confined to a scratch cgroup made for the
test (below this process's own memory cgroup); the cpu hierarchy is used at its root, as found.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import outlast
from outlast.isolation.detect import parse_proc_cgroup
from outlast.isolation.journal import CgroupFS
from tests.kernel.cgroups import cgroup_version

MiB = 1024**2
CPU_ROOT = "/sys/fs/cgroup/cpu"


def cgroups_of(pid: int | str = "self") -> dict[str, str]:
    return parse_proc_cgroup(Path(f"/proc/{pid}/cgroup").read_text())[1]


def worker_cgroups() -> dict[str, str]:
    return cgroups_of()


def _unavailable() -> str | None:
    if os.geteuid() != 0 or cgroup_version() != 1:
        return "needs root on a cgroup v1 host"
    if cgroups_of().get("cpu") != "/" or not os.path.isdir(CPU_ROOT):
        return "needs this process's cpu cgroup to be the root of the cpu hierarchy, as on these machines"
    return None


pytestmark = [pytest.mark.skipif(_unavailable() is not None, reason=_unavailable() or ""),
              pytest.mark.timeout(300)]


def in_cgroup(fs: CgroupFS, path: str) -> set[int]:
    return set(fs.pids(path))


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_outlast_start_at_the_cpu_root_confines_workers_and_leaves_every_other_process_where_it_was(monkeypatch):
    fs = CgroupFS()
    monkeypatch.delenv("OUTLAST_ADDRESS", raising=False)
    memory_mount = "/sys/fs/cgroup/memory"
    own_memory = os.path.normpath(memory_mount + cgroups_of()["memory"])
    scratch = os.path.join(own_memory, "outlast-test-" + uuid.uuid4().hex[:8])
    os.mkdir(scratch)
    fs.write(os.path.join(scratch, "memory.limit_in_bytes"), str(1536 * MiB))
    started: list[subprocess.Popen] = []

    def enter_scratch() -> None:  # memory only: the cpu cgroup stays the root, as found
        with open(os.path.join(scratch, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "outlast.cli.main", *args], capture_output=True, text=True,
                              timeout=120, preexec_fn=enter_scratch)

    try:
        # A process of the machine beside the node (stays in the root), and one in the node's
        # memory cgroup (shares the node: under user/ while it runs, back after).
        beside = subprocess.Popen(["sleep", "600"])
        inside = subprocess.Popen(["sleep", "600"], preexec_fn=enter_scratch)
        started += [beside, inside]
        root_before = in_cgroup(fs, CPU_ROOT)
        memory_before = in_cgroup(fs, own_memory)
        assert 1 in root_before and beside.pid in root_before

        r = cli("start", "--enable-resource-isolation", "--system-reserved-memory", "512MiB", "--preload", "")
        assert r.returncode == 0, r.stdout + r.stderr
        agent_pid = int(r.stdout.split("(pid ")[1].split(")")[0])
        tree = [e for e in os.listdir(CPU_ROOT) if e.startswith("outlast_")]
        node_dirs = [t for t in tree if agent_pid in in_cgroup(fs, os.path.join(CPU_ROOT, t, "system"))]
        assert len(node_dirs) == 1, tree
        node_dir = node_dirs[0]

        # Nothing of the machine moved: every process of the cpu root that still lives is still there.
        still = {p for p in root_before if alive(p)}
        # Into the node's own tree: the suite's other sessions start and move processes of their own meanwhile
        # (a worker forked in the root and moved to its node's leaf), which is no move of this node's.
        node_tree = os.path.join(CPU_ROOT, node_dir)
        in_node = {p for d, _, _ in os.walk(node_tree) for p in in_cgroup(fs, d)}
        moved = (still - in_cgroup(fs, CPU_ROOT) - {agent_pid}) & in_node
        assert moved == set(), f"processes outlast did not start were moved into its tree: {sorted(moved)}"
        assert in_cgroup(fs, os.path.join(scratch, node_dir, "user", "non-outlast")) == {inside.pid}

        with outlast.Executor(max_workers=1, num_cpus=0.5) as ex:
            where = ex.submit(worker_cgroups).result(timeout=120)
        for controller in ("memory", "cpu"):
            assert f"/{node_dir}/user/workers/task-" in where[controller], where

        r = cli("stop")
        assert r.returncode == 0, r.stdout + r.stderr
        assert not [e for e in os.listdir(CPU_ROOT) if e.startswith(node_dir)]
        assert not [e for e in os.listdir(scratch) if e.startswith("outlast_")]
        assert inside.pid in in_cgroup(fs, scratch)  # put back on stop
        assert beside.pid in in_cgroup(fs, CPU_ROOT)
        assert {p for p in memory_before if alive(p)} <= in_cgroup(fs, own_memory)
    finally:
        cli("stop")
        for proc in started:
            proc.kill()
            proc.wait()
        for _ in range(100):
            try:
                os.rmdir(scratch)
                break
            except FileNotFoundError:
                break
            except OSError:  # only what this test started can be in the scratch cgroup
                for pid in fs.pids(scratch):
                    os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)
