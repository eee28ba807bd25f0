"""An agent with isolation at the root of a cgroup v2 hierarchy (run in the guest kernel of the v2
tier): PID 1 and every process it did not start stay where they were, and a set-up that fails
halfway leaves the tree as it found it.

These tests take the whole hierarchy as their cgroup, so they run only where the machine is
the test's own: in the throw-away guest (scripts/test-cgroup-v2), never on a shared host.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from outlast.client.discovery import AgentUnavailable, start_agent_process
from outlast.isolation.detect import parse_mounts

MOUNT = parse_mounts(Path("/proc/self/mounts").read_text())[0] or "/sys/fs/cgroup"
SLOW = float(os.environ.get("OUTLAST_TEST_SLOWDOWN", "1"))

pytestmark = [pytest.mark.skipif(not os.environ.get("OUTLAST_IN_GUEST"),
                                 reason="takes the root cgroup: runs only in the v2 tier's guest kernel"),
              pytest.mark.timeout(int(300 * SLOW))]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def tree() -> dict[str, tuple[list[int], str]]:
    """Every cgroup: its live processes and what it hands to its children."""
    out = {}
    for d, _, files in os.walk(MOUNT):
        if "cgroup.procs" not in files:
            continue
        procs = sorted(int(p) for p in Path(d, "cgroup.procs").read_text().split() if alive(int(p)))
        control = Path(d, "cgroup.subtree_control").read_text().strip() if "cgroup.subtree_control" in files else ""
        out[os.path.relpath(d, MOUNT)] = (procs, control)
    return out


def assert_as_it_was(before: dict[str, tuple[list[int], str]]) -> None:
    """The same cgroups handing the same controllers down, and no process that lived through it moved.
    Processes that started or ended meanwhile on their own (the guest's, a test's leftovers) do not count."""
    after = tree()
    assert {d: c for d, (_, c) in after.items()} == {d: c for d, (_, c) in before.items()}
    was = {p: d for d, (procs, _) in before.items() for p in procs}
    now = {p: d for d, (procs, _) in after.items() for p in procs}
    moved = {p: (was[p], now[p]) for p in was.keys() & now.keys() if was[p] != now[p]}
    assert moved == {}, f"processes moved: {moved}"


def where(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return "?"


def agent(tmp_path, env=None):
    return start_agent_process([], embedded=False, log_path=tmp_path / "agent.log", timeout_s=120 * SLOW,
                               extra_args=["--node-id", "root1", "--enable-resource-isolation", "--cgroup-path", "/",
                                           "--system-reserved-memory", "256MiB"], env=env)


def test_an_agent_at_the_root_moves_nothing_it_did_not_start_and_stop_leaves_the_tree_as_found(tmp_path):
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        before = tree()
        others = {p: where(p) for procs, _ in before.values() for p in procs}
        proc, _address = agent(tmp_path)
        try:
            assert where(1) == "/"
            assert where(proc.pid) == "/outlast_root1/system"
            moved = {p: (was, where(p)) for p, was in others.items() if alive(p) and where(p) != was}
            assert moved == {}, f"moved processes the agent did not start: {moved}"
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60 * SLOW)
        assert_as_it_was(before)
        assert where(sleeper.pid) == others[sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_failure_in_the_middle_of_set_up_leaves_the_tree_as_it_was_and_says_why_in_one_paragraph(tmp_path):
    before = tree()
    with pytest.raises(AgentUnavailable, match="exited with code 3"):
        agent(tmp_path, env={"OUTLAST_FAULT_POINTS": "isolation.setup.mid=raise"})
    log = (tmp_path / "agent.log").read_text()
    assert "Traceback" not in log, log
    assert "resource isolation could not be set up in" in log and "everything it had changed was undone" in log
    assert_as_it_was(before)


def test_the_kernel_refuses_to_move_a_kernel_thread_and_outlast_reads_that_as_left_in_place(tmp_path):
    from outlast.isolation.journal import CgroupFS

    leaf = os.path.join(MOUNT, "outlast-test-kthread")
    os.mkdir(leaf)
    try:
        assert Path("/proc/2/comm").read_text().strip() == "kthreadd"
        assert CgroupFS().try_move(2, leaf) == "refused"
        assert where(2) == "/"
    finally:
        os.rmdir(leaf)
