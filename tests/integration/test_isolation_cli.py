"""`outlast start` refuses bad isolation settings before it starts anything, and says why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _outlast(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "outlast.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("flag,value", [("--system-reserved-memory", "1GiB"), ("--system-reserved-cpu", "1"),
                                        ("--cgroup-path", "/x")])
def test_a_setting_without_enable_resource_isolation_is_an_error(flag, value):
    r = _outlast("start", flag, value)
    assert r.returncode == 2
    assert f"{flag} given without --enable-resource-isolation" in r.stderr
    assert "no outlast node" in _outlast("status").stdout  # nothing was started


def test_a_bad_size_is_refused_with_the_accepted_forms():
    r = _outlast("start", "--enable-resource-isolation", "--system-reserved-memory", "lots")
    assert r.returncode == 2 and "write e.g. 2GiB" in r.stderr


def test_a_cgroup_path_that_does_not_exist_is_refused_before_any_write():
    r = _outlast("start", "--enable-resource-isolation", "--cgroup-path", "/outlast-no-such-cgroup-4711")
    assert r.returncode == 2
    assert "does not exist" in r.stderr and "nothing was changed" in r.stderr
