"""Rank 0's TCPStore listens before any rank hears its port: a rank that reached for the store
before it listened would wait out torch's connect backoff on every restart. And the attempt's keys
go under a name of its own, so a stranger that reaches the store's port is never met."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

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
        port, _ = value  # and the name the attempt's keys go under
        with socket.socket() as s:  # what a peer rank does once it has the port
            told.append((port, s.connect_ex(("127.0.0.1", port))))
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


STRANGER = """
import sys, datetime, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False, timeout=datetime.timedelta(seconds=60))
# torch's own key names, as a rank of another attempt or run that reached this port would write them
dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=datetime.timedelta(seconds=60))
"""

RANK_ONE = """
import os, sys, datetime, torch, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=dist.PrefixStore(sys.argv[2], store), rank=1, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
t = torch.ones(1)
dist.all_reduce(t)
print(int(t.item()), flush=True)
"""


@pytest.mark.torch
def test_a_stranger_that_writes_torchs_keys_in_the_attempts_store_is_never_met(monkeypatch, tmp_path):
    """A rank of another attempt or run that reaches this attempt's store port (the kernel hands ports out again,
    and torch retries a store's port for its whole timeout) registers itself first under torch's key names, then
    goes away: rank 0 meets its own rank 1, never the stranger, and their all_reduce sums the two ranks' ones."""
    import torch.distributed as dist

    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    started = []

    def broadcast(value):
        port, name = value
        probe = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
        before = probe.num_keys()
        stranger = subprocess.Popen([sys.executable, "-c", STRANGER, str(port)], env=env)
        started.append(stranger)
        deadline = time.monotonic() + 60
        while probe.num_keys() == before and time.monotonic() < deadline:  # its gloo address is in the store
            time.sleep(0.05)
        rank_one = subprocess.Popen([sys.executable, "-c", RANK_ONE, str(port), name], env=env,
                                    stdout=subprocess.PIPE, text=True)
        started.append(rank_one)
        return value

    monkeypatch.setattr(collective, "broadcast_from_rank_zero", broadcast)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    context = TrainContext(world_rank=0, world_size=2, local_rank=0, local_world_size=2, node_rank=0,
                           experiment_name="x", attempt=1, storage_path="/tmp")
    backend = TorchBackend()
    try:
        backend.on_start(context)
        started[0].kill()  # the stranger goes, as a rank being torn down does
        started[0].wait()
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2
        out, _ = started[1].communicate(timeout=60)
        assert out.strip() == "2"
    finally:
        backend.on_shutdown()
        for p in started:
            p.kill()
            p.wait()
