"""A workload's threads follow its share of the node's CPUs, unless the user said how many."""

from __future__ import annotations

import subprocess
import sys

import pytest

from outlast.threads import cpu_share_threads, follow_cpu_share


@pytest.mark.parametrize("requested, node_cpus, ranks, threads", [
    (None, 2.0, 2, 1),     # two ranks on two cores: one thread each, not two
    (None, 8.0, 3, 2),     # whole threads, rounded down
    (None, 2.0, 4, 1),     # more ranks than cores: still one
    (None, 16.0, 1, 16),   # a rank alone has the node
    (4.0, 16.0, 2, 4),     # a request wins over the split
    (0.5, 16.0, 2, 1),     # a fraction of a CPU is one thread
    (None, float("inf"), 1, 1),
])
def test_a_workloads_threads_are_its_request_or_its_share_of_the_node(requested, node_cpus, ranks, threads):
    assert cpu_share_threads(requested, node_cpus, ranks) == threads


def test_the_users_own_setting_wins_and_an_unset_one_is_filled_in():
    env = {"OMP_NUM_THREADS": "3"}
    assert follow_cpu_share(1, env) == 3 and env["OMP_NUM_THREADS"] == "3"
    env = {}
    assert follow_cpu_share(2, env) == 2 and env["OMP_NUM_THREADS"] == "2"
    env = {"OMP_NUM_THREADS": "lots"}  # not a count: the share is used
    assert follow_cpu_share(2, env) == 2 and env["OMP_NUM_THREADS"] == "2"
    env = {}
    assert follow_cpu_share(0, env) is None and env == {}


@pytest.mark.torch
def test_torch_loaded_before_the_fork_is_told_too():
    # torch read the environment when it was imported (in the fork server, before any rank existed):
    # the variable set afterwards must reach it through its own calls.
    code = ("import os, torch\n"
            "from outlast.threads import follow_cpu_share\n"
            "before = torch.get_num_threads()\n"
            "env = dict(os.environ); env.pop('OMP_NUM_THREADS', None)\n"
            "follow_cpu_share(1, env)\n"
            "print(before, torch.get_num_threads(), torch.get_num_interop_threads())\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    _, after, interop = map(int, out.split())
    assert (after, interop) == (1, 1)
