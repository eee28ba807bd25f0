"""Hostile paths at the memory tier's doors, on real agents: a hold, an offer or a fetch that names a file
outside its copy (through '..', an absolute path, or a link in the rank's directory or in the tier) gets an
answer saying why, nothing is written or read outside the tier, and the agent goes on answering; a worker
whose report names such a file fails its run, saying so, and its node writes nothing."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import msgspec
import pytest
import zmq

from outlast.agent.tier_client import ASKER, TransferError, TransferSealer, ask, fetch
from outlast.errors import TrainingFailedError
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.protocol.transport import HEADER, TIER_REPLIES, connect_dealer, encode
from outlast.storage.checksum import hash_file
from outlast.storage.memtier import CopyKey
from outlast.storage.tier_store import copy_dir, default_root
from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.hostile_jobs import report_outside_loop

# From a copy's partial directory (<tier>/<node>/<run>/<checkpoint>/rank-R.partial) to the tier's parent.
UP = "../../../../../"


def raw(kind: str, **fields) -> bytes:
    """A frame as a peer that builds its own bytes sends it: nothing checked on the way out."""
    return HEADER + msgspec.msgpack.encode({"type": kind, **fields})


def entry(path: str, where: Path) -> dict:
    return {"path": path, "size": where.stat().st_size, "xxh3_128": hash_file(where)[1]}


def send(sock: zmq.Socket, frame: bytes, timeout_s: float = 60) -> list[bytes]:
    sock.send(frame)
    assert sock.poll(int(timeout_s * 1000)), "the tier server did not answer"
    return sock.recv_multipart()


def ask_raw(ctx, key, address: str, frame: bytes) -> m.TierReply:
    sock = connect_dealer(ctx, address, key=key)
    try:
        return TIER_REPLIES.decode(send(sock, frame)[0])
    finally:
        sock.close(linger=0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(2, preload=[], workdir=tmp_path_factory.mktemp("cl")) as c:
        ctx = zmq.Context()
        yield c, ctx, ClusterKey.load(c.key_file), {n.node_id: n.tier_address for n in c.node_table()}
        ctx.destroy(linger=0)


def still_answers(ctx, key, tier: str, tmp_path: Path) -> None:
    """The agent keeps a valid hold after whatever it was sent."""
    src = tmp_path / f"valid-{uuid.uuid4().hex[:8]}"
    (src / "sub").mkdir(parents=True)
    (src / "sub/model.pt").write_bytes(os.urandom(4096))
    hold = m.TierHold(run="valid", checkpoint_dir=src.name, rank=0, seq=1,
                      files=[m.FileEntry(**entry("sub/model.pt", src / "sub/model.pt"))], source_dir=str(src))
    stored = ask(ctx, key, tier, hold, timeout_s=60)
    assert isinstance(stored, m.TierStored) and stored.ok, stored


def test_a_hold_naming_a_file_outside_the_tier_is_refused_and_writes_nothing_there(cluster, tmp_path):
    c, ctx, key, tiers = cluster
    name = f"escaped-{uuid.uuid4().hex}.txt"
    source_dir = tmp_path / "src/a/b/c/d/e"
    source_dir.mkdir(parents=True)
    (tmp_path / "src" / name).write_bytes(b"the rank's bytes")  # at source_dir / UP / name
    stored = ask_raw(ctx, key, tiers["node-1"], raw(
        "TierHold", run="run", checkpoint_dir="checkpoint_000_000001", rank=0, seq=1, source_dir=str(source_dir),
        files=[entry(UP + name, tmp_path / "src" / name)]))
    assert isinstance(stored, m.TierStored) and not stored.ok
    assert "is not a relative path inside its directory" in stored.reason and UP + name in stored.reason
    assert not (c.tier_dir.parent / name).exists()
    assert not list(c.tier_dir.rglob(name))
    still_answers(ctx, key, tiers["node-1"], tmp_path)


@pytest.mark.parametrize("where", ["up", "absolute"])
def test_an_offer_naming_a_file_outside_the_tier_is_refused_and_creates_nothing(cluster, tmp_path, where):
    c, ctx, key, tiers = cluster
    name = f"offered-{uuid.uuid4().hex}.txt"
    (tmp_path / "x").write_bytes(b"x")
    path, target = (UP + name, c.tier_dir.parent / name) if where == "up" else \
        (str(tmp_path / name), tmp_path / name)
    stored = ask_raw(ctx, key, tiers["node-0"], raw(
        "TierOffer", run="run", checkpoint_dir="checkpoint_000_000002", rank=0, seq=2,
        files=[{**entry("x", tmp_path / "x"), "path": path}]))
    assert isinstance(stored, m.TierStored) and not stored.ok
    assert "is not a relative path inside its directory" in stored.reason
    assert not target.exists()
    still_answers(ctx, key, tiers["node-0"], tmp_path)


def test_a_link_in_the_ranks_directory_is_not_followed_out_of_it(cluster, tmp_path):
    c, ctx, key, tiers = cluster
    secret = tmp_path / "secret"
    secret.write_bytes(b"not the rank's to read" * 100)
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.pt").symlink_to(secret)
    # The worst case: the rank knows the secret's size and checksum, and names a peer for the replica.
    for link in (False, True):
        hold = m.TierHold(run="run", checkpoint_dir=f"checkpoint_000_00001{int(link)}", rank=0, seq=3,
                          files=[m.FileEntry(**entry("model.pt", secret))], source_dir=str(src),
                          peer_address=tiers["node-0"], link=link)
        stored = ask(ctx, key, tiers["node-1"], hold, timeout_s=60)
        assert not stored.ok and "goes through the link 'model.pt'" in stored.reason, stored
        assert stored.replica_node == "" and "link" in stored.replica_reason, stored
        for node in ("node-0", "node-1"):
            with pytest.raises(TransferError):
                fetch(ctx, key, tiers[node], CopyKey("run", hold.checkpoint_dir, 0), tmp_path / f"got-{node}-{link}")
    still_answers(ctx, key, tiers["node-1"], tmp_path)


def test_a_fetch_reads_only_the_copys_own_files_and_no_link_planted_in_the_tier(cluster, tmp_path):
    c, ctx, key, tiers = cluster
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.pt").write_bytes(os.urandom(1000))
    hold = m.TierHold(run="run", checkpoint_dir="checkpoint_000_000020", rank=0, seq=4,
                      files=[m.FileEntry(**entry("model.pt", src / "model.pt"))], source_dir=str(src))
    assert ask(ctx, key, tiers["node-1"], hold, timeout_s=60).ok
    copy = copy_dir(c.tier_dir, "node-1", CopyKey("run", hold.checkpoint_dir, 0))
    (copy / "extra.txt").write_bytes(b"not a file of the copy")

    # Through an open transfer's data socket: a path out of the copy, a file beside it, then one of its own.
    sock = connect_dealer(ctx, tiers["node-1"], key=key)
    offer = TIER_REPLIES.decode(send(sock, encode(m.TierFetch(run="run", checkpoint_dir=hold.checkpoint_dir,
                                                              rank=0)))[0])
    assert isinstance(offer, m.TierOffer) and offer.transfer is not None
    data = connect_dealer(ctx, offer.transfer.data_address)
    sealer = TransferSealer(offer.transfer, ASKER)
    ids = dict(run="run", checkpoint_dir=hold.checkpoint_dir, rank=0, session=offer.transfer.session)
    try:
        for path, why in ((UP + "../../../../../../../etc/hostname", "not a relative path inside"),
                          ("/etc/hostname", "not a relative path inside"),
                          ("extra.txt", "is not a file of")):
            frames = send(data, raw("TierFetch", **ids, path=path, offset=0, length=100))
            reply = TIER_REPLIES.decode(frames[0])
            assert isinstance(reply, m.TierStored) and not reply.ok and why in reply.reason, (path, reply)
        frames = send(data, encode(m.TierFetch(**ids, path="model.pt", offset=0, length=1000)))
        chunk = TIER_REPLIES.decode(frames[0])
        assert isinstance(chunk, m.TierChunk)
        assert sealer.open(frames[0], chunk, frames[1]) == (src / "model.pt").read_bytes()
    finally:
        data.close(linger=0)
        sock.close(linger=0)

    # A link planted where the copy's file was (the same size as it, to be read whole) is not followed.
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(1000))
    (copy / "model.pt").unlink()
    (copy / "model.pt").symlink_to(secret)
    with pytest.raises(TransferError, match="goes through the link"):
        fetch(ctx, key, tiers["node-1"], CopyKey("run", hold.checkpoint_dir, 0), tmp_path / "fetched")
    assert not (tmp_path / "fetched/model.pt").exists() or \
        (tmp_path / "fetched/model.pt").read_bytes() != secret.read_bytes()
    still_answers(ctx, key, tiers["node-1"], tmp_path)


def test_a_worker_whose_report_names_a_file_outside_its_checkpoint_fails_the_run_and_nothing_is_written(
        cluster, tmp_path, monkeypatch):
    c, ctx, key, tiers = cluster
    monkeypatch.setenv("OUTLAST_ADDRESS", c.head_address)  # each test's environment is cleared of it
    name = f"reported-{uuid.uuid4().hex}.txt"
    local_dir = tmp_path / "ckpt/a/b/c/d/e"
    local_dir.mkdir(parents=True)
    (tmp_path / "ckpt" / name).write_bytes(b"the worker's bytes")  # at local_dir / UP / name
    storage = tmp_path / "storage"
    storage.mkdir()
    failed = None
    try:
        Trainer(report_outside_loop, train_loop_config={"local_dir": str(local_dir), "path": UP + name},
                scaling_config=ScalingConfig(num_workers=1),
                run_config=RunConfig(name="hostile", storage_path=str(storage),
                                     failure_config=FailureConfig(max_failures=0))).fit()
    except TrainingFailedError as e:
        failed = str(e)
    for tiers_dir in (c.tier_dir, default_root()):  # the cluster's nodes, or a node of the driver's own
        assert not (tiers_dir.parent / name).exists() and not list(tiers_dir.rglob(name))
    assert not list((storage / "hostile").rglob(name))
    assert failed is not None and "rank 0" in failed and f"'{UP}{name}'" in failed and "RefusedMessage" in failed, \
        failed
    failures = [f for a in json.loads((storage / "hostile/run_state.json").read_text())["attempts"]
                for f in a.get("failures", [])]
    assert [(f["kind"], f["node_id"] in tiers) for f in failures] == [("RefusedMessage", True)], failures
    assert UP + name in failures[0]["message"]
