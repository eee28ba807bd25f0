"""Which GPUs a node offers and which of them each worker gets (outlast/agent/gpus.py)."""

from __future__ import annotations

import argparse

import pytest

from outlast.agent.gpus import (GpuBook, detected_ids, node_gpu_ids, own_device_indices, visible_ids,
                                worker_gpu_env)
from outlast.agent.node_core import Fork, NodeCore
from outlast.protocol import messages as m
from outlast.slurm.allocation import gpus_on_node
from outlast.slurm.node import agent_argv

DEV = ["null", "nvidiactl", "nvidia-uvm", "nvidia1", "nvidia0", "nvidia10", "nvidia-caps"]


def test_a_node_names_its_gpus_as_cuda_visible_devices_does_else_as_dev_has_them():
    assert detected_ids(DEV) == ["0", "1", "10"]
    assert node_gpu_ids(None, {}, DEV) == ["0", "1", "10"]  # not told: what the machine has
    assert node_gpu_ids(None, {}, ["null"]) == []
    assert node_gpu_ids(None, {"CUDA_VISIBLE_DEVICES": "3, 1"}, DEV) == ["3", "1"]  # the agent's own view wins
    assert node_gpu_ids(None, {"CUDA_VISIBLE_DEVICES": ""}, DEV) == []  # hidden from it: none
    assert node_gpu_ids(None, {"CUDA_VISIBLE_DEVICES": "GPU-9f2a,GPU-11bc"}, []) == ["GPU-9f2a", "GPU-11bc"]
    assert visible_ids(None) is None


def test_num_gpus_takes_the_first_ones_or_trusts_the_operator_where_none_are_seen():
    assert node_gpu_ids(2, {}, DEV) == ["0", "1"]
    assert node_gpu_ids(2.0, {"CUDA_VISIBLE_DEVICES": "4,5,6"}, []) == ["4", "5"]
    assert node_gpu_ids(3, {}, []) == ["0", "1", "2"]  # a CPU machine told it has 3: CUDA will say otherwise
    assert node_gpu_ids(0, {}, DEV) == []


@pytest.mark.parametrize("num, env, match", [
    (4, {"CUDA_VISIBLE_DEVICES": "0,1"}, r"--num-gpus 4 but CUDA_VISIBLE_DEVICES='0,1' names 2 device\(s\): give "
                                         r"--num-gpus 2 or less"),
    (1, {"CUDA_VISIBLE_DEVICES": ""}, r"names 0 device"),
    (1.5, {}, r"--num-gpus 1.5: a node offers whole GPUs; give a whole number"),
])
def test_num_gpus_that_cannot_be_is_refused_saying_what_to_give(num, env, match):
    with pytest.raises(ValueError, match=match):
        node_gpu_ids(num, env, DEV)


def test_slurm_gives_the_agent_its_gpu_count_and_its_step_names_the_devices():
    step = {"SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "2,3"}  # the job's GPUs 2 and 3 of the node
    args = argparse.Namespace(node_id="n1", host="0.0.0.0", num_cpus=8.0, preload="", node_timeout=5.0,
                              address="", failure_domain="", labels="")
    argv = agent_argv(args, gpus_on_node(step))
    count = float(argv[argv.index("--num-gpus") + 1])
    assert count == 2 and node_gpu_ids(count, step, DEV) == ["2", "3"]
    assert agent_argv(args, gpus_on_node({}))[argv.index("--num-gpus") + 1] == "0"


def test_workers_get_whole_gpus_no_other_live_worker_holds_and_give_them_back():
    book = GpuBook(["0", "1", "2", "3"])
    a = book.assign([("a", 1, 0), ("a", 1, 1)], 1)
    assert a == {("a", 1, 0): ["0"], ("a", 1, 1): ["1"]}
    b = book.assign([("b", 1, 0)], 2)
    assert b == {("b", 1, 0): ["2", "3"]}
    refused = book.assign([("c", 1, 0)], 1)
    assert refused == "1 worker(s) asking 1 GPU(s) each do not fit in the 0 of 4 GPU(s) free on this node"
    book.release(("a", 1, 1))
    assert book.assign([("c", 1, 0)], 1) == {("c", 1, 0): ["1"]}
    book.release_all()
    assert book.free() == {"0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0}


def test_a_request_that_does_not_fit_whole_takes_nothing():
    book = GpuBook(["0", "1"])
    assert isinstance(book.assign([("a", 1, r) for r in range(3)], 1), str)
    assert book.held == {} and book.free() == {"0": 1.0, "1": 1.0}


def test_shares_of_a_gpu_pack_onto_one_device_until_it_is_full():
    book = GpuBook(["0", "1"])
    got = book.assign([("a", 1, r) for r in range(4)], 0.5)
    assert [got[("a", 1, r)] for r in range(4)] == [["0"], ["0"], ["1"], ["1"]]
    assert isinstance(book.assign([("b", 1, 0)], 0.25), str)
    assert book.assign([("b", 1, 0)], 1.5) == ("each worker asks 1.5 GPUs: ask a whole number of GPUs, "
                                               "or a share of one (less than 1)")
    assert book.assign([("c", 1, 0)], 0) == {("c", 1, 0): []}


def test_every_rank_sees_the_runs_gpus_in_the_nodes_order_and_its_own_by_index():
    node = ["4", "5", "6", "7"]
    assert worker_gpu_env(node, ["7", "5"], ["7"]) == {"CUDA_VISIBLE_DEVICES": "5,7", "OUTLAST_CUDA_DEVICES": "1"}
    assert worker_gpu_env(node, ["4", "5", "6", "7"], ["6", "7"])["OUTLAST_CUDA_DEVICES"] == "2,3"


def test_a_worker_uses_the_devices_its_node_gave_it_else_its_local_rank():
    assert own_device_indices({"OUTLAST_CUDA_DEVICES": "2,3"}, local_rank=1, device_count=4) == [2, 3]
    assert own_device_indices({}, local_rank=5, device_count=4) == [1]
    assert own_device_indices({}, local_rank=0, device_count=0) == []


def test_each_workers_environment_carries_the_runs_gpus_and_its_own():
    book = GpuBook(["0", "1", "2"])
    book.assign([("other", 1, 0)], 1)  # GPU 0 is another run's
    envs = book.worker_envs([("a", 1, 0), ("a", 1, 1)], 1, {"OUTLAST_X": "1"})
    assert envs[("a", 1, 0)] == {"OUTLAST_X": "1", "CUDA_VISIBLE_DEVICES": "1,2", "OUTLAST_CUDA_DEVICES": "0"}
    assert envs[("a", 1, 1)]["OUTLAST_CUDA_DEVICES"] == "1"
    assert book.worker_envs([("cpu", 1, 0)], 0, {"OUTLAST_X": "1"}) == {("cpu", 1, 0): {"OUTLAST_X": "1"}}
    assert isinstance(book.worker_envs([("b", 1, 0)], 1, {}), str)


def _spawn(run_id: str, ranks: list[int], gpus: float) -> m.SpawnWorkers:
    return m.SpawnWorkers(run_id=run_id, attempt=1, controller_address="tcp://c", payload=b"",
                          workers=[m.WorkerSpec(rank=r, local_rank=r, local_world_size=len(ranks), node_rank=0,
                                                world_size=len(ranks)) for r in ranks],
                          env={"OUTLAST_X": "1"}, cwd="/", sys_path=[], run_name="exp", restore_checkpoint=None,
                          resources={"CPU": 1.0, "GPU": gpus}, agent_pid=7)


def test_the_nodes_core_forks_each_rank_with_its_gpus_refuses_what_does_not_fit_and_frees_them_on_reaping():
    core = NodeCore("n", 7, ["0", "1"])
    forks = [e for e in core.on_request(b"c", _spawn("a", [0, 1], 1), 0.0) if isinstance(e, Fork)]
    assert [(f.spec.rank, f.env["CUDA_VISIBLE_DEVICES"], f.env["OUTLAST_CUDA_DEVICES"]) for f in forks] == \
        [(0, "0,1", "0"), (1, "0,1", "1")]
    assert all(f.env["OUTLAST_X"] == "1" for f in forks)
    [refused] = core.on_request(b"d", _spawn("b", [0], 1), 0.0)
    assert isinstance(refused.msg, m.SpawnRefused)
    assert refused.msg.reason == "node n: 1 worker(s) asking 1 GPU(s) each do not fit in the 0 of 2 GPU(s) free on this node"
    core.on_fork_server(m.Forked(run_id="a", attempt=1, rank=1, pid=11), 0.0)
    core.on_fork_server(m.Reaped(run_id="a", attempt=1, rank=1, pid=11, exit_code=0, signal=None, error=None), 0.0)
    [fork] = [e for e in core.on_request(b"d", _spawn("b", [0], 1), 0.0) if isinstance(e, Fork)]
    assert fork.env["CUDA_VISIBLE_DEVICES"] == "1" and fork.env["OUTLAST_CUDA_DEVICES"] == "0"
    cpu = [e for e in NodeCore("m", 7).on_request(b"c", _spawn("c", [0], 0), 0.0) if isinstance(e, Fork)]
    assert cpu[0].env == {"OUTLAST_X": "1"}  # no GPU asked: nothing of CUDA set
