"""The cluster key over real ZeroMQ sockets on loopback: right key in, wrong or no key out.

First bare sockets, then real agents: a member with the wrong key or none, a request with
the wrong key, and malformed messages from a peer that does hold the key.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import zmq

from outlast.client.discovery import AgentUnavailable, request
from outlast.protocol import messages as m
from outlast.protocol.auth import AuthError, ClusterKey, connect_checked, start_authenticator
from outlast.protocol.transport import AGENT_EVENTS, AGENT_REQUESTS, HEADER, encode
from outlast.testing import LocalCluster
from tests.integration.procs import wait_until


@pytest.fixture
def server():
    ctx = zmq.Context()
    key = ClusterKey.generate()
    auth = start_authenticator(ctx, key)
    sock = ctx.socket(zmq.ROUTER)
    key.serve(sock)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield ctx, key, sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)
    auth.stop()
    ctx.term()


def _client(ctx, key=None):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if key is not None:
        key.connect_as_client(sock)
    return sock


@pytest.fixture
def clients():
    made = []
    yield made
    for sock in made:
        sock.close(linger=0)


def test_a_client_with_the_cluster_key_is_admitted_and_its_messages_arrive(server, clients):
    ctx, key, sock, address = server
    client = _client(ctx, key)
    clients.append(client)
    connect_checked(client, address, 5000)
    client.send(encode(m.Ping()))
    assert sock.poll(5000)
    assert isinstance(AGENT_REQUESTS.decode(sock.recv_multipart()[-1]), m.Ping)


def test_a_client_with_another_key_is_refused_with_a_clear_error_and_never_heard(server, clients):
    ctx, _key, sock, address = server
    intruder = _client(ctx, ClusterKey.generate())
    clients.append(intruder)
    with pytest.raises(AuthError, match="refused this cluster key"):
        connect_checked(intruder, address, 5000)
    intruder.send(encode(m.Shutdown()))
    assert not sock.poll(500)


def test_a_client_without_any_key_is_never_heard(server, clients):
    ctx, _key, sock, address = server
    plain = _client(ctx)
    clients.append(plain)
    plain.connect(address)
    plain.send(encode(m.Shutdown()))
    assert not sock.poll(500)


def test_a_key_file_round_trips_and_is_private(tmp_path):
    key = ClusterKey.generate()
    path = tmp_path / "cluster.key"
    key.save(path)
    assert ClusterKey.load(path).public == key.public
    assert path.stat().st_mode & 0o077 == 0


def test_a_missing_or_broken_key_file_says_what_to_do(tmp_path):
    with pytest.raises(AuthError, match="copy it from the head node"):
        ClusterKey.load(tmp_path / "nope.key")
    (tmp_path / "bad.key").write_bytes(b"not a key")
    (tmp_path / "bad.key").chmod(0o600)  # private, or it is refused before it is read
    with pytest.raises(AuthError, match="not a valid cluster key"):
        ClusterKey.load(tmp_path / "bad.key")


# ---- with real agents: joining, requests, malformed messages ------------------------------------


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def head():
    """A one-node cluster (its head) whose key is in `head.key_file`; this process's env untouched."""
    cluster = LocalCluster(num_nodes=1)
    yield cluster
    cluster.shutdown()


@pytest.fixture
def other_machine(tmp_path):
    """Runs the CLI with its own OUTLAST_HOME, as on another machine; stops what it started."""
    home = tmp_path / "other-machine"
    env = {k: v for k, v in os.environ.items()
           if k not in ("OUTLAST_ADDRESS", "OUTLAST_CLUSTER_KEY", "OUTLAST_CLUSTER_SECRET")}
    env["OUTLAST_HOME"] = str(home)

    def outlast(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "outlast.cli.main", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=90, env=env)

    outlast.home = home
    yield outlast
    if (home / "node.json").exists():
        outlast("stop", "--timeout", "5")


def _host_port(address: str) -> str:
    return address.split("://", 1)[-1]


def test_a_member_with_another_clusters_key_is_refused_with_a_clear_message(head, other_machine, tmp_path):
    wrong = tmp_path / "fresh.key"
    ClusterKey.generate().save(wrong)
    started = other_machine("start", "--preload", "", "--address", _host_port(head.head_address),
                            "--cluster-key", str(wrong))
    assert started.returncode != 0
    assert f"could not join the cluster whose head is at {_host_port(head.head_address)}" in started.stderr
    assert "refused this cluster key" in started.stderr and "key file of the cluster's head" in started.stderr
    assert not (other_machine.home / "node.json").exists()
    assert [n.node_id for n in head.node_table()] == ["node-0"]


def test_a_member_without_a_key_file_is_refused_and_told_where_to_get_one(head, other_machine):
    started = other_machine("start", "--preload", "", "--address", _host_port(head.head_address))
    assert started.returncode != 0
    assert f"no cluster key at {other_machine.home / 'cluster.key'}" in started.stderr
    assert "copy it from the head node" in started.stderr
    assert [n.node_id for n in head.node_table()] == ["node-0"]


def test_a_request_with_the_wrong_key_raises_agent_unavailable_saying_the_key_was_refused(
        head, tmp_path, monkeypatch):
    ctx = zmq.Context()
    try:
        with pytest.raises(AgentUnavailable, match="refused this cluster key"):
            request(ctx, head.head_address, m.Ping(), timeout_s=5.0, key=ClusterKey.generate())
        # As a driver or the CLI finds it: the key file named by $OUTLAST_CLUSTER_KEY.
        wrong = tmp_path / "fresh.key"
        ClusterKey.generate().save(wrong)
        monkeypatch.setenv("OUTLAST_CLUSTER_KEY", str(wrong))
        with pytest.raises(AgentUnavailable, match="refused this cluster key"):
            request(ctx, head.head_address, m.StatusRequest(), timeout_s=5.0)
        monkeypatch.setenv("OUTLAST_CLUSTER_KEY", str(head.key_file))
        assert isinstance(request(ctx, head.head_address, m.Ping(), timeout_s=5.0), m.Pong)
    finally:
        ctx.term()


def test_malformed_messages_with_the_right_key_are_logged_and_dropped_and_the_agent_keeps_answering(head):
    log = head.nodes["node-0"].log_path
    ctx = zmq.Context()
    sock = _client(ctx, ClusterKey.load(head.key_file))
    try:
        connect_checked(sock, head.head_address, 5000)
        sock.send(random.Random(0).randbytes(64))
        sock.send(HEADER + msgspec.msgpack.encode({"type": "NoSuchMessage", "node_id": "x"}))
        sock.send(encode(m.Pong(node_id="x", pid=1)))  # a real message, but no request
        sock.send(encode(m.Ping()))
        assert sock.poll(5000), "the agent stopped answering after malformed messages"
        assert isinstance(AGENT_EVENTS.decode(sock.recv()), m.Pong)
        assert not sock.poll(200)  # nothing answered the malformed ones
    finally:
        sock.close(linger=0)
        ctx.term()
    wait_until(lambda: log.read_text().count("dropped a malformed request") == 3, 10, "three log lines")
    assert "NoSuchMessage" in log.read_text()


def test_a_request_of_another_protocol_version_is_refused_and_answered_in_ours(head):
    from outlast.protocol.transport import MAGIC

    log = head.nodes["node-0"].log_path
    ctx = zmq.Context()
    sock = _client(ctx, ClusterKey.load(head.key_file))
    try:
        connect_checked(sock, head.head_address, 5000)
        sock.send(MAGIC + bytes([m.PROTOCOL_VERSION + 1]) + encode(m.StatusRequest())[len(HEADER):])
        assert sock.poll(5000), "a request of another version got no answer"
        assert sock.recv()[:len(HEADER)] == HEADER  # a newer client reads the agent's version there
    finally:
        sock.close(linger=0)
        ctx.term()
    wait_until(lambda: f"protocol version {m.PROTOCOL_VERSION + 1} and this process version "
                       f"{m.PROTOCOL_VERSION}" in log.read_text(), 10, "the refusal in the agent's log")


def test_a_driver_told_by_an_agent_of_another_version_says_both_versions(server):
    import threading

    from outlast.protocol.transport import MAGIC

    ctx, key, sock, address = server

    def answer_as_another_version():
        if sock.poll(10000):
            ident, _ = sock.recv_multipart()
            sock.send_multipart([ident, MAGIC + bytes([m.PROTOCOL_VERSION + 1])
                                 + encode(m.Pong(node_id="n", pid=1))[len(HEADER):]])

    t = threading.Thread(target=answer_as_another_version)
    t.start()
    try:
        with pytest.raises(AgentUnavailable, match=f"version {m.PROTOCOL_VERSION + 1} and this process version "
                                                   f"{m.PROTOCOL_VERSION}"):
            request(ctx, address, m.Ping(), timeout_s=10.0, key=key)
    finally:
        t.join()
