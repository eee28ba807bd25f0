"""The cluster key over real ZeroMQ sockets on loopback: right key in, wrong or no key out."""

from __future__ import annotations

import pytest
import zmq

from outlast.protocol import messages as m
from outlast.protocol.auth import AuthError, ClusterKey, connect_checked, start_authenticator
from outlast.protocol.transport import AGENT_REQUESTS, encode


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
    with pytest.raises(AuthError, match="not a valid cluster key"):
        ClusterKey.load(tmp_path / "bad.key")
