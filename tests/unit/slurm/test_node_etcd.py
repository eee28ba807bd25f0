"""`outlast slurm --etcd`: the flags reach every node's agent through the step's environment."""

from __future__ import annotations

import argparse

from outlast.cluster.etcd_store import EtcdConfig
from outlast.slurm.node import agent_argv, etcd_argv


def test_every_agent_of_the_job_gets_the_etcd_flags_and_no_head_address_is_needed(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    env = EtcdConfig.parse("https://e1:2379,https://e2:2379", cacert=str(ca), user="trainer", password="pw").env()
    assert etcd_argv(env) == ["--etcd", "https://e1:2379,https://e2:2379", "--etcd-cacert", str(ca),
                              "--etcd-user", "trainer"]  # the password stays in the environment
    assert etcd_argv({}) == []
    args = argparse.Namespace(node_id="n1", host="10.0.0.1", num_cpus=4.0, preload="", node_timeout=5.0, address="",
                              failure_domain="", labels="")
    assert "--address" not in agent_argv(args, 0) and "--etcd" not in agent_argv(args, 0)  # this process's env
