"""A fuzzer on every door of a node, with real processes: the agent's control socket, the tier server's
request and data sockets, the fork server's pipe (the controller's socket: test_fuzz_controller.py).

Each example sends a batch of generated frames (tests/fuzz/hostile.py: valid messages with hostile fields,
wrong types, truncated frames, the wrong number of frames), from a peer holding the cluster key. After
each batch the process is still up and answers a valid request, nothing appeared in a canary directory
outside its roots, and no answer carried the canary's secret. A peer without the key is refused at the
handshake. bench/fuzz_doors.py runs the same doors 100,000 times each.
"""

from __future__ import annotations

import random

import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from outlast.protocol import messages as m
from outlast.protocol.auth import AuthError, ClusterKey, connect_checked
from outlast.protocol.transport import encode, tune
from outlast.testing import LocalCluster
from tests.fuzz.doors import AgentDoor, ForkServerDoor, TierDataDoor, TierDoor, outside_writes, plant_canary
from tests.fuzz.hostile import Hostile, Targets

BATCH = 25
# No shrinking: a case is a seed, and a smaller seed is no simpler case (and a dead server fails each in 30 s).
FUZZ = settings(max_examples=8, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture
def canary(tmp_path_factory):
    # One per test (Hypothesis's examples share it): what one door wrote outside its root is not another's.
    return plant_canary(tmp_path_factory.mktemp("fuzz") / "canary")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with LocalCluster(num_nodes=1, preload=[], node_args=["--checkpoint-memory", "64MiB"],
                      workdir=tmp_path_factory.mktemp("node")) as cluster:
        cluster.wait_ready()
        yield cluster


def _tier_address(cluster: LocalCluster) -> str:
    # By its id: the agent's fuzzing registers hostile nodes in the same table.
    return next(n.tier_address for n in cluster.node_table() if n.node_id == "node-0")


def _batch(door, canary, seed: int) -> None:
    h = Hostile(random.Random(seed), Targets(str(canary)))
    for _ in range(BATCH):
        door.knock(h)
    assert door.alive() is None
    assert outside_writes(canary) == []
    assert door.secrets_read == 0


@pytest.fixture(scope="module")
def agent_door(node):
    door = AgentDoor(node.head_address, ClusterKey.load(node.key_file), next(iter(node.nodes.values())).proc)
    yield door
    door.close()


@pytest.fixture(scope="module")
def tier_door(node):
    door = TierDoor(_tier_address(node), ClusterKey.load(node.key_file))
    yield door
    door.close()


@pytest.fixture(scope="module")
def tier_data_door(tmp_path_factory):
    # A node of its own: the request socket's fuzzing may end the tier server of the other.
    with LocalCluster(num_nodes=1, preload=[], node_args=["--checkpoint-memory", "64MiB"],
                      workdir=tmp_path_factory.mktemp("data-node")) as cluster:
        door = TierDataDoor(_tier_address(cluster), ClusterKey.load(cluster.key_file))
        yield door
        door.close()


@FUZZ
@given(seed=st.integers(0, 2**32))
def test_the_agent_survives_hostile_requests_from_a_key_holder_and_writes_nothing_outside_its_roots(
        agent_door, canary, seed):
    _batch(agent_door, canary, seed)


@FUZZ
@given(seed=st.integers(0, 2**32))
def test_the_tier_server_survives_hostile_requests_and_writes_nothing_outside_its_tier(tier_door, canary, seed):
    _batch(tier_door, canary, seed)


@FUZZ
@given(seed=st.integers(0, 2**32))
def test_the_tier_data_socket_survives_strangers_and_hostile_chunks_and_reads_nothing_outside_its_tier(
        tier_data_door, canary, seed):
    _batch(tier_data_door, canary, seed)


@settings(max_examples=4, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32))
def test_the_fork_server_survives_malformed_frames_on_its_pipe(fork_door, canary, seed):
    _batch(fork_door, canary, seed)


@pytest.fixture(scope="module")
def fork_door(tmp_path_factory):
    door = ForkServerDoor(tmp_path_factory.mktemp("forkroot"))
    yield door
    door.close()


def test_a_peer_without_the_cluster_key_is_refused_at_the_handshake_by_the_agent_and_the_tier(node):
    stranger = ClusterKey.generate()
    ctx = zmq.Context()
    try:
        for address in (node.head_address, _tier_address(node)):
            sock = tune(ctx.socket(zmq.DEALER))
            stranger.connect_as_client(sock)
            with pytest.raises(AuthError):
                connect_checked(sock, address, timeout_ms=10_000)
            sock.close(linger=0)
            # Without CURVE at all: the frames go nowhere, and nothing answers.
            plain = tune(ctx.socket(zmq.DEALER))
            plain.connect(address)
            plain.send(encode(m.Ping()))
            plain.send(encode(m.TierList()))
            assert not plain.poll(1000)
            plain.close(linger=0)
    finally:
        ctx.destroy(linger=0)
    door = AgentDoor(node.head_address, ClusterKey.load(node.key_file))
    try:
        assert door.alive() is None
    finally:
        door.close()
