"""Isolation on a host as it comes: at the root of a hierarchy nothing but outlast moves, what the
kernel will not move is left where it is, a failed set-up undoes itself and says so in one
paragraph, unreadable memory counts as a full node, and v1's stalled user/ has a way out."""

from __future__ import annotations

import logging
import os

import pytest

from outlast.isolation.cgroup_v1 import CgroupV1
from outlast.isolation.config import IsolationConfig
from outlast.isolation.errors import IsolationError
from outlast.isolation.node import NodeIsolation
from outlast.isolation.policy import Action, KillCandidate, PolicyConfig
from outlast.protocol.kinds import WorkloadKind
from outlast.isolation.reservations import GiB, compute_reservations
from tests.fakes.cgroups import v1_tree

AGENT, INIT, KTHREAD, OTHER = os.getpid(), 1, 2, 999101
RES = compute_reservations(8 * GiB, None, 4, reserved_memory=1 * GiB, reserved_cpus=1)


def snapshot(fs, top: str) -> dict[str, list[int]]:
    """Every cgroup under `top` with its processes."""
    return {d: sorted(fs.pids(d)) for d, _, files in os.walk(top) if "cgroup.procs" in files}


@pytest.fixture
def at_root(tmp_path):
    """cpu at the root of its hierarchy with the whole machine in it (as on these VMs); memory in a job cgroup."""
    fs, mounts = v1_tree(tmp_path)
    fs.make(mounts["cpu"], procs=[INIT, KTHREAD, OTHER, AGENT])
    fs.make(f"{mounts['memory']}/job", procs=[AGENT, OTHER, KTHREAD])
    fs.unmovable = {KTHREAD}
    return fs, mounts


def driver(tree, cpu_path="/"):
    fs, mounts = tree
    return CgroupV1(mounts, {"memory": "/job", "cpu": cpu_path}, "n1", fs=fs, self_pids=[AGENT])


def test_at_the_root_of_a_hierarchy_only_outlast_moves_and_stop_puts_it_back(at_root):
    fs, mounts = at_root
    before = snapshot(fs, mounts["cpu"])
    d = driver(at_root)
    d.setup(RES)
    assert sorted(fs.pids(mounts["cpu"])) == sorted([INIT, KTHREAD, OTHER])  # init and the rest stay
    assert fs.pids(f"{mounts['cpu']}/outlast_n1/system") == [AGENT]
    assert fs.pids(f"{mounts['cpu']}/outlast_n1/user/non-outlast") == []
    assert d.teardown() == []
    assert snapshot(fs, mounts["cpu"]) == before


def test_a_process_the_kernel_will_not_move_is_skipped_counted_and_logged_once(at_root, caplog):
    fs, mounts = at_root
    d = driver(at_root)
    with caplog.at_level(logging.INFO, logger="outlast.isolation"):
        d.setup(RES)
    job = f"{mounts['memory']}/job"
    assert fs.pids(job) == [KTHREAD]
    assert fs.pids(f"{job}/outlast_n1/user/non-outlast") == [OTHER]  # below the root: shares the node
    assert d.journal.refused == [KTHREAD]
    assert [r.message for r in caplog.records if "will not move" in r.message] == [
        f"left 1 process in {job}: the kernel will not move it (kernel threads, or real-time tasks a v1 cpu "
        f"cgroup cannot take): pids {KTHREAD}"]
    assert d.teardown() == []
    assert sorted(fs.pids(job)) == sorted([AGENT, OTHER, KTHREAD])


def test_a_failure_in_the_middle_of_set_up_undoes_it_and_says_so_in_one_paragraph(at_root):
    fs, mounts = at_root
    before = {h: snapshot(fs, h) for h in mounts.values()}
    fs.fail_write = "user/cpu.shares"
    with pytest.raises(IsolationError) as raised:
        NodeIsolation.start(IsolationConfig(enable_resource_isolation=True), "n1", driver=driver(at_root))
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("resource isolation could not be set up in ")
    assert "PermissionError" in message and "everything it had changed was undone" in message
    assert "--cgroup-path" in message
    assert {h: snapshot(fs, h) for h in mounts.values()} == before


class StatlessDriver:
    """A driver whose memory.stat cannot be read."""

    version, root = 1, "/fake/outlast_n1"

    def sample(self):
        return {"unreadable": "cannot read memory.stat under /fake/outlast_n1: [Errno 5] Input/output error"}

    def monitors(self, limit, kill_at):
        return []

    def teardown(self):
        return []


def task(name, pid, mem):
    return KillCandidate(name=name, kind=WorkloadKind.TASK, owner=name, rank=None, pid=pid, memory_bytes=mem,
                         started_at=990.0)


def test_memory_that_cannot_be_read_counts_as_a_full_node_and_the_monitor_says_so(caplog):
    n = NodeIsolation(StatlessDriver(), RES, "n1", PolicyConfig(kill_at=0.95, target=0.90), clock=lambda: 1000.0)
    n._arm()
    with caplog.at_level(logging.ERROR, logger="outlast.isolation"):
        decision = n.check([task("a", 11, 1 * GiB)], {11}, "threshold")
    assert decision.action is Action.KILL
    assert any("counting the node as full" in r.message and "Input/output error" in r.message
               for r in caplog.records)


def test_v1_stalled_by_other_processes_alone_is_handed_to_the_kernel_and_taken_back_with_workers(at_root, caplog):
    fs, mounts = at_root
    d = driver(at_root)
    d.setup(RES)
    oom = f"{mounts['memory']}/job/outlast_n1/user/memory.oom_control"
    fs._put(oom, "oom_kill_disable 1\nunder_oom 1\noom_kill 0")  # only non-outlast processes fill it
    n = NodeIsolation(d, RES, "n1", PolicyConfig(kill_at=0.95, target=0.90), clock=lambda: 1000.0)
    with caplog.at_level(logging.WARNING, logger="outlast.isolation"):
        assert n.check([], set(), "kernel event").action is Action.WAIT
    assert (oom, "0") in fs.writes
    assert any("handed it back to the kernel's OOM killer" in r.message for r in caplog.records)
    fs._put(oom, "oom_kill_disable 0\nunder_oom 0\noom_kill 3")
    n.check([task("a", 11, 1 * GiB)], {11}, "threshold")
    assert fs.writes[-1] == (oom, "1")
    d.teardown()


def test_at_the_root_what_a_dead_agent_left_goes_back_to_the_root_not_under_user(at_root):
    fs, mounts = at_root
    stale = f"{mounts['cpu']}/outlast_gone"
    for sub in ("", "/system", "/user", "/user/workers", "/user/non-outlast"):
        fs.make(stale + sub)
    fs.make(stale + "/user/non-outlast", procs=[OTHER])
    d = driver(at_root)
    d.setup(RES)
    d.cleanup_stale()
    assert OTHER in fs.pids(mounts["cpu"]) and not os.path.exists(stale)
    d.teardown()
