"""Which cgroup version manages memory on this machine, and where the agent's cgroups are."""

from __future__ import annotations

import os

from outlast.isolation.cgroup_v1 import CgroupV1
from outlast.isolation.cgroup_v2 import CgroupV2
from outlast.isolation.errors import IsolationUnavailable


def parse_mounts(text: str) -> tuple[str | None, dict[str, str]]:
    """(the cgroup2 mount point, {v1 controller: its mount point}) from /proc/self/mounts."""
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        _, mountpoint, fstype, options = parts[:4]
        if fstype == "cgroup2" and v2 is None:
            v2 = mountpoint
        elif fstype == "cgroup":
            for opt in options.split(","):
                if opt in ("memory", "cpu", "cpuacct", "cpuset", "pids", "freezer", "blkio", "devices"):
                    v1.setdefault(opt, mountpoint)
    return v2, v1


def parse_proc_cgroup(text: str) -> tuple[str | None, dict[str, str]]:
    """(the v2 path, {v1 controller: path}) from /proc/self/cgroup."""
    v2, v1 = None, {}
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            v2 = path
        for c in controllers.split(","):
            if c:
                v1[c] = path
    return v2, v1


def detect(node_id: str, cgroup_path: str | None, mounts_text: str | None = None,
           proc_cgroup_text: str | None = None) -> CgroupV1 | CgroupV2:
    """The driver for this machine: v1 if the memory controller is bound to a v1 hierarchy."""
    if mounts_text is None:
        mounts_text = _read("/proc/self/mounts")
    if proc_cgroup_text is None:
        proc_cgroup_text = _read("/proc/self/cgroup")
    v2_mount, v1_mounts = parse_mounts(mounts_text)
    v2_path, v1_paths = parse_proc_cgroup(proc_cgroup_text)
    if "memory" in v1_mounts:
        if "cpu" not in v1_mounts:
            raise IsolationUnavailable(["the memory controller is on cgroup v1 but no cgroup v1 cpu hierarchy is "
                                        "mounted; mount one (mount -t cgroup -o cpu none /sys/fs/cgroup/cpu)"])
        paths = {c: cgroup_path if cgroup_path is not None else v1_paths.get(c, "/") for c in ("memory", "cpu")}
        return CgroupV1({"memory": v1_mounts["memory"], "cpu": v1_mounts["cpu"]}, paths, node_id)
    if v2_mount is None:
        raise IsolationUnavailable(["no cgroup file system is mounted; mount cgroup2 on /sys/fs/cgroup "
                                    "(mount -t cgroup2 none /sys/fs/cgroup)"])
    path = cgroup_path if cgroup_path is not None else (v2_path or "/")
    if path.startswith(v2_mount.rstrip("/") + "/"):
        path = path[len(v2_mount.rstrip("/")):]  # an absolute file-system path was given
    return CgroupV2(v2_mount, path, node_id)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def own_cgroup_dirs() -> list[str]:
    """The directories of this process's cgroups (for tests and status)."""
    v2_mount, v1_mounts = parse_mounts(_read("/proc/self/mounts"))
    v2_path, v1_paths = parse_proc_cgroup(_read("/proc/self/cgroup"))
    if "memory" in v1_mounts:
        return [os.path.normpath(v1_mounts[c] + v1_paths.get(c, "/")) for c in ("memory", "cpu") if c in v1_mounts]
    return [os.path.normpath((v2_mount or "/sys/fs/cgroup") + (v2_path or "/"))]
