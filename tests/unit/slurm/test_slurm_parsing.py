"""Reading what Slurm tells a job: its environment, host lists, `scontrol show -o` records."""

from __future__ import annotations

import pytest

from outlast.slurm.allocation import (
    SlurmEnvError, allocation_from_env, expand_counts, expand_hostlist, gpus_on_node, not_on_first_node,
)
from outlast.slurm.scontrol import job_info, node_states, parse_record, parse_time, partition_grace_s

NODE_LINE = (
    "NodeName=n2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=1 CPUEfctv=1 CPUTot=1 CPULoad=3.29 AvailableFeatures=rack_a "
    "ActiveFeatures=rack_a Gres=(null) NodeAddr=127.0.0.1 NodeHostName=vm Port=17002 Version=22.05.8 "
    "OS=Linux 6.18.44-fc-v509 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1000 AllocMem=0 FreeMem=14614 Sockets=1 "
    "Boards=1 State=ALLOCATED+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=low,high "
    " BootTime=2026-11-30T14:07:57 SlurmdStartTime=2026-11-30T14:14:10 LastBusyTime=2026-11-30T14:14:10 "
    "CfgTRES=cpu=1,mem=1000M,billing=1 AllocTRES=cpu=1 CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s "
    "ExtSensorsWatts=0 ExtSensorsTemp=n/s Reason=maintenance in 300s Foo=bar [root@2026-11-30T14:14:30]"
)
JOB_LINE = (
    "JobId=7 JobName=probe.sh UserId=root(0) GroupId=root(0) JobState=RUNNING Reason=None Requeue=1 Restarts=2 "
    "BatchFlag=1 TimeLimit=00:05:00 StartTime=2026-11-30T14:14:16 EndTime=2026-11-30T14:19:16 Deadline=N/A "
    "PreemptTime=2026-11-30T14:14:19 Partition=low AllocNode:Sid=localhost:5931 NodeList=n[1-2] "
    "TRES=cpu=2,node=2,billing=2 CPUs/Task=1 Command=/tmp/probe.sh"
)


def test_host_lists_expand_ranges_lists_and_zero_padding():
    assert expand_hostlist("n[1-3,7],gpu[01-02]x,login1") == ["n1", "n2", "n3", "n7", "gpu01x", "gpu02x", "login1"]
    assert expand_hostlist("n1") == ["n1"]


@pytest.mark.parametrize("bad", ["n[1-3", "n[a-b]", "n[3-1]"])
def test_a_host_list_slurm_would_not_write_is_refused_with_what_is_wrong(bad):
    with pytest.raises(SlurmEnvError, match="host list"):
        expand_hostlist(bad)


def test_per_node_counts_expand():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(SlurmEnvError, match="per-node count"):
        expand_counts("2(3)")


def test_the_allocation_comes_from_the_job_environment():
    alloc = allocation_from_env({"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "n[1-2],m5",
                                 "SLURM_JOB_CPUS_PER_NODE": "4(x2),8", "SLURM_RESTART_COUNT": "3",
                                 "SLURM_JOB_PARTITION": "low"})
    assert alloc.nodes == ["n1", "n2", "m5"]
    assert alloc.cpus == {"n1": 4.0, "n2": 4.0, "m5": 8.0}
    assert (alloc.job_id, alloc.restart_count, alloc.partition) == ("12", 3, "low")
    assert allocation_from_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a"}).restart_count == 0


def test_outside_an_allocation_the_error_says_where_to_run_it():
    with pytest.raises(SlurmEnvError, match="sbatch script or an salloc shell"):
        allocation_from_env({})
    with pytest.raises(SlurmEnvError, match="names 1 nodes"):
        allocation_from_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_CPUS_PER_NODE": "2"})


def test_gpus_come_from_the_step_gres():
    assert gpus_on_node({"SLURM_GPUS_ON_NODE": "4"}) == 4
    assert gpus_on_node({"SLURM_STEP_GPUS": "0,1"}) == 2
    assert gpus_on_node({"CUDA_VISIBLE_DEVICES": "0,1"}) == 0  # not from Slurm: not counted


def test_a_node_record_keeps_values_with_spaces_and_equals_and_the_reason_whole():
    rec = parse_record(NODE_LINE)
    assert rec["OS"] == "Linux 6.18.44-fc-v509 #1 SMP PREEMPT_DYNAMIC @0"
    assert rec["CfgTRES"] == "cpu=1,mem=1000M,billing=1"
    assert rec["Reason"] == "maintenance in 300s Foo=bar [root@2026-11-30T14:14:30]"
    (node,) = node_states(NODE_LINE)
    assert node.name == "n2" and node.draining and not node.down
    assert node.states == {"ALLOCATED", "DRAIN"}
    assert node.reason == "maintenance in 300s Foo=bar"
    assert node.reason_set_at == parse_time("2026-11-30T14:14:30")
    assert (node.addr, node.features) == ("127.0.0.1", ["rack_a"])


def test_a_job_record_gives_its_deadlines_and_restarts():
    job = job_info(JOB_LINE)
    assert (job.job_id, job.partition, job.restarts, job.state) == ("7", "low", 2, "RUNNING")
    assert job.end_time == parse_time("2026-11-30T14:19:16")
    assert job.preempt_time == parse_time("2026-11-30T14:14:19")
    unlimited = job_info(JOB_LINE.replace("EndTime=2026-11-30T14:19:16", "EndTime=Unknown")
                         .replace("PreemptTime=2026-11-30T14:14:19", "PreemptTime=None"))
    assert unlimited.end_time is None and unlimited.preempt_time is None
    with pytest.raises(ValueError, match="no job"):
        job_info("slurm_load_jobs error: Invalid job id specified")


def test_partition_grace_time():
    assert partition_grace_s("PartitionName=low AllowGroups=ALL GraceTime=30 Hidden=NO") == 30.0
    assert partition_grace_s("PartitionName=high GraceTime=0") == 0.0


def test_it_runs_on_the_first_node_of_the_job_and_says_where_to_go_otherwise():
    alloc = allocation_from_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert not_on_first_node({"SLURMD_NODENAME": "n1"}, alloc) is None
    assert "on node n2" in not_on_first_node({"SLURMD_NODENAME": "n2"}, alloc)
    assert "srun --nodes=1 --pty -w n1 bash" in not_on_first_node({}, alloc)
