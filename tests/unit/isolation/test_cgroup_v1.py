"""The v1 driver against a fake tree: the same layout per hierarchy, the OOM killer off, undo."""

import os
import subprocess

import pytest

from outlast.isolation.cgroup_v1 import CgroupV1
from outlast.isolation.errors import IsolationUnavailable
from outlast.isolation.reservations import GiB, compute_reservations
from outlast.protocol.messages import Resources
from tests.fakes.cgroups import v1_tree

AGENT, OTHER = os.getpid(), 999101
RES = compute_reservations(8 * GiB, None, 4, reserved_memory=1 * GiB, reserved_cpus=1)


@pytest.fixture
def tree(tmp_path):
    fs, mounts = v1_tree(tmp_path)
    fs.make(f"{mounts['memory']}/job", procs=[AGENT, OTHER], memory__limit_in_bytes=str(4 * GiB))
    fs.make(f"{mounts['cpu']}/job", procs=[AGENT, OTHER])
    return fs, mounts


def driver(tree, node="n1"):
    fs, mounts = tree
    return CgroupV1(mounts, {"memory": "/job", "cpu": "/job"}, node, fs=fs, self_pids=[AGENT])


def test_setup_limits_user_disables_the_oom_killer_and_splits_cpu_shares(tree):
    fs, mounts = tree
    d = driver(tree)
    d.validate()
    d.setup(RES)
    mem, cpu = f"{mounts['memory']}/job/outlast_n1", f"{mounts['cpu']}/job/outlast_n1"
    assert fs.read(f"{mem}/user/memory.limit_in_bytes") == str(7 * GiB)
    assert fs.read(f"{mem}/user/memory.oom_control") == "1"
    assert fs.read(f"{cpu}/system/cpu.shares") == "2560" and fs.read(f"{cpu}/user/cpu.shares") == "7680"
    for h in (mem, cpu):
        assert fs.pids(f"{h}/system") == [AGENT] and fs.pids(f"{h}/user/non-outlast") == [OTHER]


def test_teardown_restores_both_hierarchies(tree):
    fs, mounts = tree
    d = driver(tree)
    d.setup(RES)
    assert d.teardown() == []
    for h in mounts.values():
        assert not os.path.exists(f"{h}/job/outlast_n1")
        assert sorted(fs.pids(f"{h}/job")) == sorted([AGENT, OTHER])


def test_starting_limit_comes_from_the_memory_hierarchy(tree):
    assert driver(tree).starting_limit() == 4 * GiB


def test_validation_explains_use_hierarchy_and_missing_hierarchies(tree, tmp_path):
    fs, mounts = tree
    fs._put(f"{mounts['memory']}/job/memory.use_hierarchy", "0")
    with pytest.raises(IsolationUnavailable, match="use_hierarchy is 0"):
        driver(tree).validate()
    broken = CgroupV1({"memory": mounts["memory"], "cpu": str(tmp_path / "nocpu")}, {"memory": "/job", "cpu": "/job"},
                      "n1", fs=fs)
    with pytest.raises(IsolationUnavailable, match="no cgroup v1 cpu hierarchy"):
        broken.validate()


def test_leaves_exist_in_both_hierarchies_with_cpu_shares(tree):
    fs, mounts = tree
    d = driver(tree)
    d.setup(RES)
    procs = d.create_leaf("task-x", Resources(num_cpus=0.5))
    assert len(procs) == 2 and all(p.endswith("/user/workers/task-x/cgroup.procs") for p in procs)
    assert fs.read(f"{mounts['cpu']}/job/outlast_n1/user/workers/task-x/cpu.shares") == "512"
    assert d.remove_leaf("task-x")


def test_the_sample_reports_a_stall_and_counts_rss_and_all_shmem(tree):
    fs, mounts = tree
    d = driver(tree)
    d.setup(RES)
    mem = f"{mounts['memory']}/job/outlast_n1"
    fs._put(f"{mem}/user/memory.stat", "total_rss 700\ntotal_cache 9000\ntotal_shmem 5")
    fs._put(f"{mem}/memory.stat", "total_rss 900\ntotal_shmem 25")
    fs._put(f"{mem}/user/memory.oom_control", "oom_kill_disable 1\nunder_oom 1\noom_kill 0")
    s = d.sample()
    assert s["counted"] == 725 and s["stalled"] is True and s["limit"] == 7 * GiB


def test_a_crashed_agents_tree_is_removed_from_both_hierarchies(tree):
    fs, mounts = tree
    p = subprocess.Popen(["true"])
    p.wait()
    for h in mounts.values():
        fs.make(f"{h}/job/outlast_gone/system", procs=[p.pid])
        fs.make(f"{h}/job/outlast_gone/user/workers")
    d = driver(tree)
    d.setup(RES)
    assert len(d.cleanup_stale()) == 2
    assert not any(os.path.exists(f"{h}/job/outlast_gone") for h in mounts.values())


def test_a_killed_agents_fork_server_still_ending_does_not_keep_its_tree_in_either_hierarchy(tree, dying_fork_server):
    fs, mounts = tree
    for h in mounts.values():
        fs.make(f"{h}/job/outlast_n1/system", procs=[dying_fork_server])
    driver(tree).validate()  # the same node id again: not refused as a running agent's
    for h in mounts.values():
        fs.make(f"{h}/job/outlast_gone/system", procs=[dying_fork_server])
    d = driver(tree, node="n2")
    d.setup(RES)
    assert len([n for n in d.cleanup_stale() if "left by an agent that is gone" in n]) == 4
    assert not any(os.path.exists(f"{h}/job/outlast_gone") for h in mounts.values())


def test_an_agent_started_again_with_its_node_id_takes_back_the_tree_its_killed_self_left(tree):
    """A node whose agent was killed (kill -9, the machine's processes lost) starts again with the
    same node id: its old tree is there, owned by no live process, with a dead worker's leaf."""
    fs, mounts = tree
    for h in mounts.values():  # the kernel took the dead processes out of cgroup.procs
        for sub in ("", "/system", "/user", "/user/workers", "/user/workers/old-leaf", "/user/non-outlast"):
            fs.make(f"{h}/job/outlast_n1{sub}")
    d = driver(tree)
    d.validate()
    d.setup(RES)
    notes = d.cleanup_stale()
    for h in mounts.values():
        assert AGENT in fs.pids(f"{h}/job/outlast_n1/system")
        assert not os.path.exists(f"{h}/job/outlast_n1/user/workers/old-leaf")
    assert any("old-leaf" in n for n in notes)
    assert d.teardown() == []
    assert not any(os.path.exists(f"{h}/job/outlast_n1") for h in mounts.values())
