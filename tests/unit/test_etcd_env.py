"""etcd's client settings stay with the processes that use etcd: never carried to workers."""

from __future__ import annotations

from outlast.cluster.etcd_store import EtcdConfig
from outlast.runenv import carried_env, worker_env


def test_a_run_carries_no_etcd_setting_and_a_worker_never_sees_etcds_password():
    etcd = EtcdConfig.parse("http://e1:2379", user="trainer", password="s3cret").env()
    driver = {**etcd, "OUTLAST_DRIVER_TIMEOUT_S": "9"}
    assert carried_env(driver, None) == {"OUTLAST_DRIVER_TIMEOUT_S": "9"}
    node = {**etcd, "PATH": "/usr/bin"}  # an agent started by `outlast slurm --etcd` has them
    env = worker_env(node, carried_env(driver, None))
    assert "OUTLAST_ETCD_PASSWORD" not in env and env["PATH"] == "/usr/bin"
