"""Rank 0's TCPStore listens before any rank hears its port: a rank that reached for the store
before it listened would wait out torch's connect backoff on every restart."""

from __future__ import annotations

import socket

import pytest

from outlast.train import collective
from outlast.train.context import TrainContext
from outlast.train.torch.backend import TorchBackend

torch = pytest.importorskip("torch")


@pytest.mark.torch
def test_rank_zero_tells_a_port_its_store_already_listens_on(monkeypatch):
    import torch.distributed as dist

    told = []

    def broadcast(value):
        with socket.socket() as s:  # what a peer rank does once it has the port
            told.append((value, s.connect_ex(("127.0.0.1", value))))
        return value

    monkeypatch.setattr(collective, "broadcast_from_rank_zero", broadcast)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    context = TrainContext(world_rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                           experiment_name="x", attempt=1, storage_path="/tmp")
    backend = TorchBackend()
    try:
        backend.on_start(context)
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        backend.on_shutdown()
    [(port, connected)] = told
    assert connected == 0, f"nothing listened on port {port} when rank 0 told it"
