"""The v2 driver against a fake tree: layout, values, kernel rules, undo, crashed agents."""

import os
import subprocess

import pytest

from outlast.isolation.cgroup_v2 import CgroupV2
from outlast.isolation.errors import IsolationUnavailable
from outlast.isolation.reservations import GiB, MiB, compute_reservations
from outlast.protocol.messages import Resources
from tests.fakes.cgroups import v2_tree

AGENT, OTHER = os.getpid(), 999001


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.fixture
def tree(tmp_path):
    fs, mount = v2_tree(tmp_path)
    fs.make(f"{mount}/svc", procs=[AGENT, OTHER])
    fs._put(f"{mount}/cgroup.subtree_control", "cpu memory")
    return fs, mount


def driver(tree, node="n1"):
    fs, mount = tree
    return CgroupV2(mount, "/svc", node, fs=fs, self_pids=[AGENT])


RES = compute_reservations(8 * GiB, None, 4, reserved_memory=1 * GiB, reserved_cpus=1)


def test_setup_builds_the_layout_with_its_values(tree):
    fs, mount = tree
    d = driver(tree)
    d.validate()
    d.setup(RES)
    base = f"{mount}/svc/outlast_n1"
    assert fs.read(f"{base}/system/memory.low") == str(1 * GiB)
    assert fs.read(f"{base}/user/memory.high") == str(7 * GiB)
    assert fs.read(f"{base}/system/cpu.weight") == "2500"
    assert fs.read(f"{base}/user/cpu.weight") == "7500"
    assert fs.pids(f"{base}/system") == [AGENT]
    assert fs.pids(f"{base}/user/non-outlast") == [OTHER]  # what lived in <cgroup-path> moved down
    assert fs.pids(f"{mount}/svc") == []  # no processes where controllers are handed on
    for path in (f"{mount}/svc", base, f"{base}/user", f"{base}/user/workers"):
        assert set(fs.read(f"{path}/cgroup.subtree_control").split()) == {"cpu", "memory"}


def test_processes_move_out_before_controllers_are_enabled_top_down(tree):
    fs, _ = tree
    driver(tree).setup(RES)
    kinds = [(os.path.basename(p), v) for p, v in fs.writes]
    first_enable = next(i for i, (f, _) in enumerate(kinds) if f == "cgroup.subtree_control")
    last_move = max(i for i, (f, _) in enumerate(kinds) if f == "cgroup.procs")
    assert last_move < first_enable
    enabled = [p for p, _ in fs.writes if p.endswith("cgroup.subtree_control")]
    assert enabled == sorted(enabled, key=len)  # parents before children


def test_teardown_undoes_everything_in_reverse(tree):
    fs, mount = tree
    before = fs.read(f"{mount}/svc/cgroup.subtree_control")
    d = driver(tree)
    d.setup(RES)
    assert d.teardown() == []
    assert not os.path.exists(f"{mount}/svc/outlast_n1")
    assert sorted(fs.pids(f"{mount}/svc")) == sorted([AGENT, OTHER])
    assert fs.read(f"{mount}/svc/cgroup.subtree_control") == before


def test_a_failed_write_midway_is_undone_by_teardown(tree):
    fs, mount = tree
    d = driver(tree)
    fs.fail_write = "user/memory.high"
    with pytest.raises(PermissionError):
        d.setup(RES)
    d.teardown()
    assert not os.path.exists(f"{mount}/svc/outlast_n1")
    assert sorted(fs.pids(f"{mount}/svc")) == sorted([AGENT, OTHER])


def test_validation_lists_every_missing_controller_with_the_fix(tree):
    fs, mount = tree
    fs._put(f"{mount}/svc/cgroup.controllers", "io pids")
    with pytest.raises(IsolationUnavailable) as e:
        driver(tree).validate()
    text = str(e.value)
    assert "the cpu controller is not available" in text and "the memory controller is not available" in text
    assert "echo +memory >" in text and "Delegate=yes" in text and "nothing was changed" in text


def test_validation_refuses_a_missing_cgroup_and_a_non_cgroup2_mount(tmp_path, tree):
    fs, mount = tree
    with pytest.raises(IsolationUnavailable, match="does not exist"):
        CgroupV2(mount, "/nope", "n1", fs=fs).validate()
    with pytest.raises(IsolationUnavailable, match="not a cgroup v2 mount"):
        CgroupV2(str(tmp_path), "/", "n1", fs=fs).validate()


def test_validation_refuses_the_tree_of_a_live_agent_with_the_same_node_id(tree):
    fs, mount = tree
    fs.make(f"{mount}/svc/outlast_n1/system", procs=[os.getpid()])
    with pytest.raises(IsolationUnavailable, match="another --node-id"):
        driver(tree).validate()


def test_a_crashed_agents_tree_is_cleaned_and_its_other_processes_kept(tree):
    fs, mount = tree
    dead = _dead_pid()
    stale = f"{mount}/svc/outlast_old"
    fs.make(f"{stale}/system", procs=[dead])
    fs.make(f"{stale}/user/workers/w1", procs=[_dead_pid()])
    fs.make(f"{stale}/user/non-outlast", procs=[999002])
    d = driver(tree)
    d.setup(RES)
    notes = d.cleanup_stale()
    assert not os.path.exists(stale) and "outlast_old" in notes[0]
    assert 999002 in fs.pids(f"{mount}/svc/outlast_n1/user/non-outlast")


def test_a_live_agents_tree_is_left_alone(tree):
    fs, mount = tree
    fs.make(f"{mount}/svc/outlast_live/system", procs=[os.getppid()])  # a live process, not us
    d = driver(tree)
    d.setup(RES)
    assert d.cleanup_stale() == []
    assert os.path.exists(f"{mount}/svc/outlast_live")


def test_a_leaf_per_worker_with_its_cpu_weight_and_killed_whole(tree):
    fs, mount = tree
    d = driver(tree)
    d.setup(RES)
    procs = d.create_leaf("run1-a1-r0", Resources(num_cpus=2))
    leaf = f"{mount}/svc/outlast_n1/user/workers/run1-a1-r0"
    assert procs == [f"{leaf}/cgroup.procs"]
    assert fs.read(f"{leaf}/cpu.weight") == "200" and fs.read(f"{leaf}/memory.oom.group") == "1"
    fs.write(procs[0], "999003")
    d.kill_leaf("run1-a1-r0")
    assert ("%s/cgroup.kill" % leaf, "1") in fs.writes
    assert d.remove_leaf("run1-a1-r0") and not os.path.exists(leaf)


def test_the_sample_counts_user_anon_and_all_shared_memory_and_rereads_the_limit(tree):
    fs, mount = tree
    d = driver(tree)
    d.setup(RES)
    base = f"{mount}/svc/outlast_n1"
    fs._put(f"{base}/user/memory.stat", "anon 300\nfile 5000\nshmem 10")
    fs._put(f"{base}/memory.stat", "anon 400\nfile 9000\nshmem 50")  # 40 of shmem charged to system
    fs._put(f"{base}/user/memory.high", str(512 * MiB))
    s = d.sample()
    assert s["counted"] == 350 and s["limit"] == 512 * MiB and s["stalled"] is False


def test_the_starting_limit_is_the_smallest_on_the_way_up(tree):
    fs, mount = tree
    fs._put(f"{mount}/svc/memory.max", str(3 * GiB))
    fs.make(f"{mount}/svc/inner", memory__max="max")
    assert CgroupV2(mount, "/svc/inner", "n1", fs=fs).starting_limit() == 3 * GiB


def test_a_killed_agents_fork_server_still_ending_does_not_make_its_tree_look_owned(tree, dying_fork_server):
    fs, mount = tree
    stale = f"{mount}/svc/outlast_old"
    fs.make(f"{stale}/system", procs=[dying_fork_server])
    d = driver(tree)
    d.setup(RES)
    notes = d.cleanup_stale()
    assert not os.path.exists(stale) and "outlast_old" in notes[0]
    assert dying_fork_server in fs.pids(f"{mount}/svc/outlast_n1/user/non-outlast")  # moved out, not signalled


def test_the_same_node_id_is_refused_while_its_agent_lives_and_not_while_only_its_fork_server_does(
        tree, dying_fork_server):
    fs, mount = tree
    fs.make(f"{mount}/svc/outlast_n1/system", procs=[dying_fork_server, os.getppid()])
    with pytest.raises(IsolationUnavailable, match="belongs to a running agent"):
        driver(tree).validate()
    fs._put(f"{mount}/svc/outlast_n1/system/cgroup.procs", str(dying_fork_server))  # the agent is gone
    driver(tree).validate()


def test_an_agent_started_again_with_its_node_id_takes_back_the_tree_its_killed_self_left(tree):
    """A node whose agent was killed starts again with the same node id: its old tree is there,
    owned by no live process, with a dead worker's leaf and a process it had found at its start."""
    fs, mount = tree
    old = f"{mount}/svc/outlast_n1"
    for sub in ("", "/system", "/user", "/user/workers", "/user/workers/old-leaf", "/user/non-outlast"):
        fs.make(old + sub, procs=[OTHER] if sub == "/user/non-outlast" else None)
    d = driver(tree)
    d.validate()
    d.setup(RES)
    notes = d.cleanup_stale()
    assert AGENT in fs.pids(f"{old}/system") and OTHER in fs.pids(f"{old}/user/non-outlast")
    assert not os.path.exists(f"{old}/user/workers/old-leaf") and any("old-leaf" in n for n in notes)
    fs.write(f"{mount}/svc/cgroup.procs", str(OTHER))  # it leaves: the fake lists a pid until it moves
    d.teardown()
    assert not os.path.exists(old)
