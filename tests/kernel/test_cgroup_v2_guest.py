"""The cgroup v2 tier, run from the ordinary test command: the real-kernel tests in a guest kernel.

Hosts like ours bind memory and cpu to cgroup v1 for good, so v2 needs its own kernel:
scripts/test-cgroup-v2 boots one (user-mode Linux or QEMU TCG), installing what it needs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernel.cgroups import cgroup_version
from tests.kernel.conftest import real_cgroups_unavailable

ROOT = Path(__file__).resolve().parents[2]


def _why_not() -> str | None:
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
    why = _why_not()
    if why:
        pytest.skip(why)
    proc = subprocess.run([str(ROOT / "scripts" / "test-cgroup-v2")], cwd=ROOT, capture_output=True, text=True,
                          timeout=1700, env={**os.environ, "PYTHON": sys.executable})
    out = proc.stdout + proc.stderr
    tail = "\n".join(line for line in out.splitlines() if not line.startswith(" [<"))[-6000:]
    assert proc.returncode == 0, f"the cgroup v2 tier failed (exit {proc.returncode}):\n{tail}"
    assert " passed" in out and "GUEST_EXIT_CODE=0" in out, tail
