"""The cgroup v2 tier, run from the ordinary test command: the real-kernel tests in a guest kernel.

Hosts like ours bind memory and cpu to cgroup v1 for good, so v2 needs its own kernel:
scripts/test-cgroup-v2 boots one (user-mode Linux or QEMU TCG), installing what it needs. It starts
beside the rest of the session (tests/conftest.py, tests/kernel/guest_tier.py).
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.kernel import guest_tier
from tests.kernel.cgroups import cgroup_version
from tests.kernel.conftest import real_cgroups_unavailable


def why_not() -> str | None:
    if os.environ.get("OUTLAST_IN_GUEST"):
        return "this is the guest: the v2 tests run directly here"
    if cgroup_version() == 2 and real_cgroups_unavailable() is None:
        return "this host has cgroup v2 with memory and cpu delegated: test_real_cgroups.py covers v2 directly"
    if os.geteuid() != 0:
        return "booting a guest kernel for the cgroup v2 tier needs root"
    if not (shutil.which("qemu-system-x86_64") or shutil.which("apt-get")):
        return "no QEMU and no apt-get to install it: this machine cannot boot a guest kernel"
    return None


@pytest.mark.timeout(1800)
def test_the_real_kernel_tests_pass_on_cgroup_v2_in_a_guest_kernel():
    why = why_not()
    if why:
        pytest.skip(why)
    code, out = guest_tier.start().wait(timeout_s=1700)  # started when the session was collected
    tail = "\n".join(line for line in out.splitlines() if not line.startswith(" [<"))[-6000:]
    assert code == 0, f"the cgroup v2 tier failed (exit {code}):\n{tail}"
    assert " passed" in out and "GUEST_EXIT_CODE=0" in out, tail
