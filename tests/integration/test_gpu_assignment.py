"""What each rank of a run holding GPUs is told, on a node told it has GPUs (no device needed: the
variables are what CUDA would read), and that the fork server never initialized CUDA. The GPU
itself is exercised by scripts/gpu-check (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outlast.protocol import messages as m
from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig

VARS = ("CUDA_VISIBLE_DEVICES", "OUTLAST_CUDA_DEVICES", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
        "NODE_RANK", "OUTLAST_NODE_ID")


def record_env(config):
    import torch

    from outlast import train

    rank = train.get_context().get_world_rank()
    seen = {k: os.environ.get(k) for k in VARS}
    # Set in a forked child by torch's own fork handler when its parent had initialized CUDA.
    seen["bad_fork"] = torch.cuda._is_in_bad_fork()
    seen["cuda_initialized"] = torch.cuda.is_initialized()
    seen["device"] = str(train.torch.get_device())
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(seen))
    train.report({"done": 1})


def _run(cluster_dir: Path, storage_path: str, workers: int, per_worker: dict) -> dict[int, dict]:
    from outlast.train.torch import TorchTrainer

    out = cluster_dir / f"out-{workers}-{per_worker['GPU']}"
    out.mkdir()
    TorchTrainer(record_env, train_loop_config={"out": str(out)},
                 scaling_config=ScalingConfig(num_workers=workers, resources_per_worker=per_worker),
                 # A gloo set-up that fails ("connectFullMesh ... Connection closed by peer", seen twice in
                 # whole-suite runs) is retried on the set-up budget, not max_failures (setup_failures.py).
                 run_config=RunConfig(name=f"run-{workers}-{per_worker['GPU']}", storage_path=storage_path,
                                      failure_config=FailureConfig(max_failures=0))).fit()
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


@pytest.mark.torch
def test_ranks_get_their_gpus_by_index_among_the_runs_and_the_fork_server_never_touches_cuda(
        storage_path, tmp_path, monkeypatch):
    # The node's GPUs as Slurm would name them in a step: devices 5 and 7 of the machine.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    with LocalCluster(num_nodes=1, cpus_per_node=4) as cluster:
        cluster.add_node("gpus", extra_args=["--num-gpus", "2"])
        cluster.wait_ready()
        status = cluster._request(cluster.nodes["gpus"].address, m.StatusRequest())
        assert isinstance(status, m.StatusReply) and status.fork_server_pid > 0
        assert status.fork_server_cuda == "" and set(status.gpus) == {"5", "7"}
        two = _run(tmp_path, storage_path, 2, {"GPU": 1, "CPU": 1})
        one_with_both = _run(tmp_path, storage_path, 1, {"GPU": 2, "CPU": 1})
        # fit() returns on the workers' last word; the node frees their GPUs once it has reaped them.
        deadline = time.monotonic() + 60
        while (after := cluster._request(cluster.nodes["gpus"].address, m.StatusRequest())).gpus != \
                {"5": [], "7": []} and time.monotonic() < deadline:
            time.sleep(0.1)
    assert [two[r]["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == ["5,7", "5,7"]  # the run's GPUs, shared for NCCL
    assert [two[r]["OUTLAST_CUDA_DEVICES"] for r in (0, 1)] == ["0", "1"]  # each its own, by index
    assert [(two[r]["RANK"], two[r]["LOCAL_RANK"], two[r]["WORLD_SIZE"], two[r]["LOCAL_WORLD_SIZE"], two[r]["NODE_RANK"])
            for r in (0, 1)] == [("0", "0", "2", "2", "0"), ("1", "1", "2", "2", "0")]
    assert {two[r]["OUTLAST_NODE_ID"] for r in (0, 1)} == {"gpus"}
    assert one_with_both[0]["CUDA_VISIBLE_DEVICES"] == "5,7" and one_with_both[0]["OUTLAST_CUDA_DEVICES"] == "0,1"
    for seen in (*two.values(), *one_with_both.values()):
        assert seen["bad_fork"] is False and seen["cuda_initialized"] is False
        assert seen["device"] == "cpu"  # gloo: no NCCL without use_gpu
    # Every GPU is free again once the runs' workers are gone.
    assert after.gpus == {"5": [], "7": []}


def test_a_node_refuses_more_gpus_than_its_cuda_visible_devices_name(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1", "OUTLAST_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "outlast.agent", "--num-gpus", "4"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "--num-gpus 4 but CUDA_VISIBLE_DEVICES='0,1' names 2 device(s): give --num-gpus 2 or less" in proc.stderr
