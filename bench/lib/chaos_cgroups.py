"""The chaos cluster's cgroups: every agent runs with resource isolation, inside one scratch cgroup
made for the run below the harness's own cgroups (`tests/kernel/cgroups.ScratchCgroup`: v1 memory
and cpu here, or a v2 tree that delegates them), so that what the agents leave can be read there
and the host's own cgroups are never written. Each agent makes `outlast_<node id>/` in it, one
leaf per worker below `user/workers/`.
"""

from __future__ import annotations

import os

from tests.kernel.cgroups import ScratchCgroup, cgroup_version

MEMORY = 4 << 30  # the whole cluster's (four fork servers with torch imported); each agent counts it as its node's


def unavailable_reason() -> str | None:
    from outlast.isolation.detect import own_cgroup_dirs

    if os.geteuid() != 0:
        return "resource isolation needs root here"
    if cgroup_version() is None:
        return "no cgroup file system is mounted"
    for d in own_cgroup_dirs():
        if not os.access(d, os.W_OK):
            return f"cannot create cgroups under this process's own cgroup {d}"
    return None


class ClusterCgroups:
    def __init__(self) -> None:
        self.scratch = ScratchCgroup(MEMORY)

    def agent_args(self) -> list[str]:
        return ["--enable-resource-isolation", *self.scratch.agent_args()]

    def launcher(self):
        return self.scratch.launcher()

    def worker_leaves(self) -> list[str]:
        """Every worker leaf the agents hold now, in each hierarchy."""
        return sorted(os.path.join(d, node, "user", "workers", leaf) for d in self.scratch.dirs
                      for node in _subdirs(d) for leaf in _subdirs(os.path.join(d, node, "user", "workers")))

    def left(self) -> list[str]:
        """Every cgroup an agent made below the scratch one (once they are stopped there must be none;
        on v2 the harness's own `launch-<i>` leaves, which agents start in, are not theirs)."""
        return sorted(os.path.join(d, sub) for d in self.scratch.dirs for sub in _subdirs(d)
                      if not sub.startswith("launch-"))

    def remove(self) -> None:
        self.scratch.remove()


def _subdirs(path: str) -> list[str]:
    try:
        return sorted(e for e in os.listdir(path) if os.path.isdir(os.path.join(path, e)))
    except FileNotFoundError:
        return []
