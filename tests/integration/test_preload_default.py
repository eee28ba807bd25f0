"""`LocalCluster()` and the node a driver embeds preload what `outlast start` does."""

from __future__ import annotations

import zmq

from outlast.client.discovery import attach, request
from outlast.client.preload import with_default
from outlast.protocol import messages as m
from outlast.testing import LocalCluster
from outlast.train.backend import Backend
from tests.integration.procs import wait_until


def test_a_local_cluster_and_an_embedded_node_preload_the_one_default(monkeypatch):
    monkeypatch.setenv("OUTLAST_PRELOAD", "json,email")  # cheap modules stand in for torch's
    with LocalCluster(num_nodes=1) as cluster:
        cluster.wait_ready(60)
        reply = cluster._request(cluster.head_address, m.StatusRequest())
        assert reply.preload == ["json", "email"]
    monkeypatch.delenv("OUTLAST_ADDRESS", raising=False)
    ctx = zmq.Context()
    access = attach(ctx, with_default(Backend.preload))
    try:
        assert access.embedded is not None
        wait_until(lambda: request(ctx, access.head_address, m.StatusRequest(), timeout_s=10,
                                   key=access.key).zygote_ready, 60, "the embedded node's fork server")
        reply = request(ctx, access.head_address, m.StatusRequest(), timeout_s=10, key=access.key)
        assert reply.preload == ["json", "email"]
    finally:
        access.embedded.terminate()
        access.embedded.wait()
        access.stop_authenticator()
        ctx.term()
