"""What a worker's environment holds: its node's, what the run carries, and no key to the cluster."""

from __future__ import annotations

import json
import os
from pathlib import Path

import outlast
from outlast.protocol.auth import AuthError, connect_checked
from outlast.protocol.run_credential import CREDENTIAL_ENV, RunCredential
from outlast.protocol.transport import tune
from outlast.testing import LocalCluster
from outlast.train import RunConfig, ScalingConfig, Trainer


def dump_env(config):
    Path(config["out"]).write_text(json.dumps(dict(os.environ)))


def environment() -> dict[str, str]:
    return dict(os.environ)


def refused_by(address: str, credential_text: str) -> bool:
    import zmq

    ctx = zmq.Context()
    sock = tune(ctx.socket(zmq.DEALER))
    RunCredential.decode(credential_text).connect_as_client(sock)
    try:
        connect_checked(sock, address, 5000)
        return False
    except AuthError:
        return True
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_worker_gets_its_nodes_environment_and_what_the_run_carries_not_the_drivers(tmp_path, storage_path,
                                                                                       monkeypatch):
    monkeypatch.setenv("OUTLAST_TEST_NODE_VAR", "from-the-node")
    cluster = LocalCluster(num_nodes=1)
    try:
        with cluster:
            # Set in the driver after the node started: the node's environment has none of these.
            monkeypatch.setenv("DRIVER_ONLY_PATHLIKE", "/driver/bin")
            monkeypatch.setenv("OUTLAST_COLLECTIVE_WARN_INTERVAL_S", "7")
            out = tmp_path / "env.json"
            Trainer(dump_env, train_loop_config={"out": str(out)}, scaling_config=ScalingConfig(num_workers=1),
                    run_config=RunConfig(name="env", storage_path=storage_path,
                                         worker_runtime_env={"env_vars": {"CARRIED": "yes"}})).fit()
            env = json.loads(out.read_text())
            assert env["OUTLAST_TEST_NODE_VAR"] == "from-the-node"  # the node's own
            assert "DRIVER_ONLY_PATHLIKE" not in env  # the driver's environment does not travel
            assert env["CARRIED"] == "yes"  # what the run names does
            assert env["OUTLAST_COLLECTIVE_WARN_INTERVAL_S"] == "7"  # and the driver's outlast settings
            assert "OUTLAST_CLUSTER_SECRET" not in env
            # The run's credential reaches its driver only: the cluster's agents refuse it.
            assert refused_by(cluster.head_address, env[CREDENTIAL_ENV])
    finally:
        cluster.shutdown()


def test_an_embedded_nodes_workers_and_tasks_never_see_the_cluster_secret(tmp_path, storage_path):
    out = tmp_path / "env.json"
    Trainer(dump_env, train_loop_config={"out": str(out)},
            run_config=RunConfig(name="embedded", storage_path=storage_path)).fit()
    env = json.loads(out.read_text())
    assert "OUTLAST_CLUSTER_SECRET" not in env and CREDENTIAL_ENV in env
    with outlast.Executor(num_cpus=1) as ex:
        task_env = ex.submit(environment).result(timeout=120)
    assert "OUTLAST_CLUSTER_SECRET" not in task_env and CREDENTIAL_ENV in task_env
