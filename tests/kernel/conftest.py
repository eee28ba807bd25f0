"""The real-kernel tier: needs root and a cgroup tree this process may create children in."""

from __future__ import annotations

import os

import pytest

from tests.kernel.cgroups import cgroup_version


def real_cgroups_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create test cgroups"
    version = cgroup_version()
    if version is None:
        return "no cgroup file system mounted"
    from outlast.isolation.detect import own_cgroup_dirs

    for d in own_cgroup_dirs():
        if not os.access(d, os.W_OK):
            return f"cannot create cgroups under this process's own cgroup {d}"
    if version == 2:
        parent = own_cgroup_dirs()[0]
        try:
            have = open(os.path.join(parent, "cgroup.subtree_control")).read().split()
        except OSError:
            have = []
        if "memory" not in have or "cpu" not in have:
            return (f"cgroup v2 here, but {parent} does not hand memory and cpu to children; "
                    "the v2 tier runs in a guest kernel (tests/kernel/test_cgroup_v2_guest.py)")
    return None


@pytest.fixture
def real_cgroups():
    why = real_cgroups_unavailable()
    if why:
        pytest.skip(why)
