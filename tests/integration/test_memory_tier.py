"""The memory tier on real agents: copies held and replicated over the cluster's transport, kept across an
agent's restart, freed with an embedded node."""

import os
import signal

import pytest
import zmq

from outlast.agent.tier_client import ask, fetch
from outlast.client.discovery import start_agent_process
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.storage.checksum import hash_file
from outlast.storage.memtier import CopyKey
from outlast.testing import LocalCluster

MB = 2**20


def tier_of(cluster, node_id):
    return next(n.tier_address for n in cluster.node_table() if n.node_id == node_id)


@pytest.fixture
def ckpt(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.pt").write_bytes(os.urandom(20 * MB + 3))
    return src, [m.FileEntry(path="model.pt", size=20 * MB + 3, xxh3_128=hash_file(src / "model.pt")[1])]


def test_a_restarted_agent_reclaims_its_copies_and_its_peer_still_serves_the_replica(ckpt, tmp_path):
    src, files = ckpt
    with LocalCluster(2, preload=[]) as cluster:
        ctx = zmq.Context()
        key = ClusterKey.load(cluster.key_file)
        hold = m.TierHold(run="run", checkpoint_dir="checkpoint_000_000001", rank=0, seq=1, files=files,
                          source_dir=str(src), peer_address=tier_of(cluster, "node-0"))
        stored = ask(ctx, key, tier_of(cluster, "node-1"), hold, timeout_s=60)
        assert stored.ok and stored.replica_node == "node-0", stored
        for node in ("node-0", "node-1"):
            ack = ask(ctx, key, tier_of(cluster, node), m.TierCommit(run="run", checkpoint_dir=hold.checkpoint_dir))
            assert isinstance(ack, m.TierAck)

        cluster.kill_node("node-1")
        # While node-1 is down, the replica on node-0 is what a restore fetches.
        offer, _ = fetch(ctx, key, tier_of(cluster, "node-0"), CopyKey("run", "checkpoint_000_000001", 0),
                         tmp_path / "fetched", timeout_s=30)
        assert offer.files == files and hash_file(tmp_path / "fetched/model.pt")[1] == files[0].xxh3_128

        cluster.restart_node("node-1")
        listed = ask(ctx, key, tier_of(cluster, "node-1"), m.TierList(), timeout_s=30)
        assert [(c.checkpoint_dir, c.primary, c.committed) for c in listed.copies] == \
            [("checkpoint_000_000001", True, True)]
        assert "reclaimed 1 checkpoint copies in memory" in cluster.nodes["node-1"].log_path.read_text()
        ctx.destroy(linger=0)
    assert not cluster.tier_dir.exists()


def test_an_embedded_node_frees_its_tier_when_it_stops(tmp_path):
    root = tmp_path / "tier"
    proc, _address = start_agent_process([], embedded=True, extra_args=["--node-id", "emb"],
                                         log_path=tmp_path / "agent.log",
                                         env={"OUTLAST_TIER_DIR": str(root), "OUTLAST_HOME": str(tmp_path / "home")})
    try:
        assert (root / "emb" / "owner.json").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not (root / "emb").exists()
