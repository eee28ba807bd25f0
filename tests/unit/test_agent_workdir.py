"""A starting agent removes the directories of agents that are gone, and only those."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from outlast.agent import workdir
from outlast.client.liveness import host_id


def _owned(root, name, pid, host=None):
    d = root / name
    d.mkdir(parents=True)
    (d / workdir.OWNER).write_bytes(msgspec.json.encode(workdir.Owner(pid, host_id() if host is None else host)))
    (d / "r1-1-0.json").write_text("{}")
    return d


def test_a_gone_predecessor_is_cleaned_and_live_or_foreign_agents_are_left(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    gone = _owned(tmp_path, "n1", proc.pid)
    live = _owned(tmp_path, "n2", os.getppid())
    foreign = _owned(tmp_path, "n3", proc.pid, host="another-machine/1")
    mine = workdir.claim("n1", tmp_path)
    assert mine == gone and not (mine / "r1-1-0.json").exists()  # the predecessor's files are gone
    assert live.exists() and foreign.exists()
    workdir.release(mine)
    assert not mine.exists()


def test_a_second_live_agent_with_the_same_node_id_is_refused(tmp_path):
    _owned(tmp_path, "n1", os.getppid())
    with pytest.raises(ValueError, match="another agent with node id n1"):
        workdir.claim("n1", tmp_path)


HOLD = """
import sys, time
from pathlib import Path
from outlast.agent import workdir
workdir.claim(sys.argv[2], Path(sys.argv[1]))
print("claimed", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _holder(root, node_id, seconds=1000.0):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root), node_id, str(seconds)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def _rewrite_owner(d, pid, host):
    (d / workdir.OWNER).write_bytes(msgspec.json.encode(workdir.Owner(pid, host)))


def test_a_directory_whose_lock_is_held_is_kept_whatever_its_owner_file_says(tmp_path):
    holder = _holder(tmp_path, "n1")
    try:
        # Its owner file names a pid that is gone, on this host: the lock, not the pid, says alive.
        done = subprocess.Popen([sys.executable, "-c", "pass"])
        done.wait()
        _rewrite_owner(tmp_path / "n1", done.pid, host_id())
        with pytest.raises(ValueError, match="another agent with node id n1"):
            workdir.claim("n1", tmp_path)
    finally:
        holder.kill()
        holder.wait()
    # Its agent killed -9: the kernel let go of the lock, and the next start takes the id.
    mine = workdir.claim("n1", tmp_path)
    assert workdir._owner(mine).pid == os.getpid()
    workdir.release(mine)


@pytest.mark.parametrize("host", ["this", "another-boot-or-pid-namespace"])
def test_a_free_lock_is_a_gone_agent_even_when_its_pid_now_belongs_to_another_program(tmp_path, host):
    holder = _holder(tmp_path, "n1")
    holder.kill()
    holder.wait()
    # The pid is reused (here: by our own parent, alive), or was from another namespace or boot.
    _rewrite_owner(tmp_path / "n1", os.getppid(), host_id() if host == "this" else "b00t/4026531836")
    mine = workdir.claim("n1", tmp_path)
    assert workdir._owner(mine).pid == os.getpid()
    workdir.release(mine)


CLAIM_AT_ONCE = """
import sys, time
from pathlib import Path
from outlast.agent import workdir
root, node_id, at = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
time.sleep(max(0.0, at - time.time()))
mine = workdir.claim(node_id, root)
time.sleep(1.0)  # while the others sweep
ok = (mine / workdir.OWNER).exists() and (mine / workdir.LOCK).exists()
print("ok" if ok else "lost", flush=True)
"""


def test_agents_starting_in_the_same_instant_never_remove_each_others_directory(tmp_path):
    import time

    at = time.time() + 2.0
    procs = [subprocess.Popen([sys.executable, "-c", CLAIM_AT_ONCE, str(tmp_path), f"n{i}", str(at)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(8)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [out.strip() for out, _ in results] == ["ok"] * 8, [err for _, err in results]
