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
