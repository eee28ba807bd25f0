"""The local Slurm cluster's configuration holds what Slurm 22.05 needs on one host."""

from __future__ import annotations

import argparse
from pathlib import Path

from outlast.slurm.local_cluster import Layout, render_conf
from outlast.slurm.node import agent_argv


def test_nodes_share_the_host_on_ports_of_their_own_and_preemption_signals_the_job():
    conf = render_conf(Layout(root=Path("/x"), num_nodes=3, first_node_port=17001), "vm")
    lines = conf.splitlines()
    nodes = [ln for ln in lines if ln.startswith("NodeName=")]
    assert [ln.split()[0] for ln in nodes] == ["NodeName=n1", "NodeName=n2", "NodeName=n3"]
    assert {ln.split("Port=")[1].split()[0] for ln in nodes} == {"17001", "17002", "17003"}
    assert all("NodeHostname=vm NodeAddr=127.0.0.1" in ln for ln in nodes)
    assert "AuthInfo=socket=/x/munge/munge.socket.2,cred_expire=10" in lines
    # A SlurmctldParameters flag: under SchedulerParameters 22.05 ignores it without a word.
    assert "SlurmctldParameters=preempt_send_user_signal" in lines
    assert not any(ln.startswith("PreemptParameters") for ln in lines)  # a fatal unknown key in 22.05
    low = next(ln for ln in lines if ln.startswith("PartitionName=low"))
    assert "PreemptMode=REQUEUE" in low and "GraceTime=" in low


def test_the_node_agent_is_started_with_slurms_view_of_the_node():
    args = argparse.Namespace(node_id="n2", host="10.0.0.2", num_cpus=8.0, address="tcp://10.0.0.1:5000",
                              failure_domain="rack_a", labels="slurm_job=7", preload="torch", node_timeout=5.0)
    argv = agent_argv(args, gpus=4)
    joined = " ".join(argv)
    assert "-m outlast.agent --embedded" in joined  # stops at once on the SIGTERM that ends a step
    for flag, value in (("--node-id", "n2"), ("--num-cpus", "8.0"), ("--num-gpus", "4"),
                        ("--address", "tcp://10.0.0.1:5000"), ("--failure-domain", "rack_a")):
        assert argv[argv.index(flag) + 1] == value
    head = agent_argv(argparse.Namespace(**{**vars(args), "address": "", "failure_domain": ""}), gpus=0)
    assert "--address" not in head and "--failure-domain" not in head


def test_the_topology_puts_nodes_under_leaf_switches_that_scontrol_reports_back():
    from outlast.slurm.local_cluster import render_topology
    from outlast.slurm.scontrol import leaf_switches

    assert render_topology(Layout(root=Path("/x"), num_nodes=3)) == (
        "SwitchName=s1 Nodes=n1,n2\nSwitchName=s2 Nodes=n3\nSwitchName=top Switches=s1,s2\n")
    shown = ("SwitchName=s1 Level=0 LinkSpeed=1 Nodes=n1,n2\nSwitchName=s2 Level=0 LinkSpeed=1 Nodes=n3\n"
             "SwitchName=top Level=1 LinkSpeed=1 Nodes=n[1-3] Switches=s1,s2\n")
    assert leaf_switches(shown) == {"n1": "s1", "n2": "s1", "n3": "s2"}
