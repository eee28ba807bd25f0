"""Each rank's math threads follow its share of its node's CPUs (as Ray's workers' do), not the node's
whole count: ranks that each run a thread per core wait on one another in every collective."""

from __future__ import annotations

import pytest

from outlast.testing import LocalCluster
from outlast.train import RunConfig, ScalingConfig
from tests.integration.jobs import read_events, threads_loop


def _threads(storage_path, tmp_path, name: str, **scaling) -> dict[int, tuple]:
    from outlast.train.torch import TorchTrainer

    events = tmp_path / f"{name}.jsonl"
    env = scaling.pop("env", None)
    TorchTrainer(threads_loop, train_loop_config={"events": str(events)}, scaling_config=ScalingConfig(**scaling),
                 run_config=RunConfig(name=name, storage_path=storage_path,
                                      worker_runtime_env={"env_vars": env} if env else None)).fit()
    return {e["rank"]: (e["torch"], e["interop"], e["omp"]) for e in read_events(events)}


@pytest.mark.torch
def test_ranks_split_their_nodes_cpus_take_their_request_and_keep_a_setting_of_the_users(storage_path, tmp_path):
    # torch is imported by the fork server, before any rank exists, with a thread per core of the machine.
    with LocalCluster(num_nodes=1, cpus_per_node=2, preload=["torch"]):
        assert _threads(storage_path, tmp_path, "split", num_workers=2) == {0: (1, 1, "1"), 1: (1, 1, "1")}
        assert _threads(storage_path, tmp_path, "alone", num_workers=1) == {0: (2, 2, "2")}
        assert _threads(storage_path, tmp_path, "asked", num_workers=1,
                        resources_per_worker={"CPU": 1}) == {0: (1, 1, "1")}
        assert _threads(storage_path, tmp_path, "own", num_workers=1,
                        env={"OMP_NUM_THREADS": "1"}) == {0: (1, 1, "1")}
