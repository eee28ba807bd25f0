"""The memory tier's faults on real agents: a full tmpfs, a sender that dies mid-transfer, sizes a peer
declares, and what a run leaves in the tier at its end. The tier answers each with an error that says
what happened, lets go of what it had half-written (in files and in its budget) and goes on serving."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import zmq

from outlast.agent.tier_client import ASKER, TransferError, TransferSealer, ask, push
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.protocol.transport import TIER_REPLIES, connect_dealer, encode
from outlast.storage.checksum import hash_file
from outlast.storage.memtier import CopyKey
from outlast.testing import LocalCluster
from tests.integration.jobs import fit_counting
from tests.integration.procs import wait_until

KB, MB = 2**10, 2**20


def _tier_of(cluster, node_id: str) -> str:
    return next(n.tier_address for n in cluster.node_table() if n.node_id == node_id)




def _left_in(tier_dir: Path) -> list[str]:
    """What is under each node's tier directory but its owner file (and an empty directory of restores)."""
    return sorted(str(p.relative_to(tier_dir)) for p in tier_dir.glob("node-*/**/*")
                  if p.name != "owner.json" and not (p.name == "restores" and not any(p.iterdir())))


def _written(where: Path, name: str, size: int) -> list[m.FileEntry]:
    where.mkdir(parents=True, exist_ok=True)
    (where / name).write_bytes(os.urandom(size))
    return [m.FileEntry(path=name, size=size, xxh3_128=hash_file(where / name)[1])]


# ---- what a run leaves at its end -------------------------------------------------------------------------


def test_a_storage_run_that_restored_from_memory_leaves_nothing_of_itself_under_any_nodes_tier(
        monkeypatch, tmp_path, storage_path, capfd):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    with LocalCluster(num_nodes=2, node_timeout_s=2, cpus_per_node=2, workdir=tmp_path / "cl") as cluster:
        result = fit_counting(storage_path, events, storage="storage", pad_bytes=MB,
                      fault={"rank": 1, "step": 6, "when": "after_report", "kind": "kill"})
        left = _left_in(cluster.tier_dir)
    assert result.last_metrics == {"step": 9}
    said = "".join(capfd.readouterr())
    assert "restored checkpoint_001_000005 from local_memory" in said, said[-3000:]
    # Neither its copies nor the links its restores made: those would keep the checkpoint's bytes in RAM.
    assert left == [], left


def _bytes_in(node_dir: Path) -> int:
    """The bytes a node's tier directory takes in copies and links (each file once), its records aside."""
    files = {}
    for p in node_dir.rglob("*"):
        if p.is_file() and p.name not in ("owner.json", ".lock") and \
                not (p.parent.name.startswith("checkpoint_") and re.fullmatch(r"rank-\d+\.json", p.name)):
            files[p.stat().st_ino] = p.stat().st_size
    return sum(files.values())


def test_a_memory_run_keeps_its_copies_and_its_restore_links_pin_nothing_outside_the_budget(
        monkeypatch, tmp_path, storage_path, capfd):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    # About 2.1 MiB a checkpoint on each node: the budget keeps two, so the one restored is evicted later.
    with LocalCluster(num_nodes=2, node_timeout_s=2, cpus_per_node=2, workdir=tmp_path / "cl",
                      node_args=["--checkpoint-memory", "5MiB"]) as cluster:
        result = fit_counting(storage_path, tmp_path / "events.jsonl", storage="memory", pad_bytes=MB, steps=15,
                      fault={"rank": 0, "step": 6, "when": "after_report", "kind": "kill"})
        ctx = zmq.Context()
        try:
            key = ClusterKey.load(cluster.key_file)
            held = {n: ask(ctx, key, _tier_of(cluster, n), m.TierList(), timeout_s=30) for n in ("node-0", "node-1")}
        finally:
            ctx.destroy(linger=0)
        taken = {n: _bytes_in(cluster.tier_dir / n) for n in held}
    assert result.last_metrics == {"step": 14}
    said = "".join(capfd.readouterr())
    assert "restored checkpoint_001_000005 from local_memory" in said, said[-3000:]
    for node, holdings in held.items():
        assert holdings.copies and holdings.used_bytes + holdings.spare_bytes <= 5 * MB, (node, holdings)
        assert "checkpoint_001_000005" not in {c.checkpoint_dir for c in holdings.copies}
        # What the node's tier takes is what its budget counts (copies, and pages kept for the next one): no link
        # of the restore keeps an evicted copy.
        assert taken[node] == holdings.used_bytes + holdings.spare_bytes, (node, taken[node], holdings)


# ---- a full tmpfs -------------------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs, mounted for this test only (root is needed; skipped without it)."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(where: Path) -> Path:
    """Write a file until the file system is full."""
    filler = where / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * (64 * KB))
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return filler


def test_a_full_tmpfs_is_answered_with_its_error_and_the_agent_goes_on_holding_and_committing(
        monkeypatch, tmp_path, storage_path, small_tmpfs):
    monkeypatch.setenv("OUTLAST_TIER_DIR", str(small_tmpfs))
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    src = tmp_path / "ckpt"
    files = _written(src, "model.pt", 256 * KB)
    # Each node's budget fits in the tmpfs: what fills it is another user of the same file system.
    with LocalCluster(num_nodes=2, node_timeout_s=2, cpus_per_node=2, workdir=tmp_path / "cl",
                      node_args=["--checkpoint-memory", "1MiB"]) as cluster:
        ctx = zmq.Context()
        try:
            key, address = ClusterKey.load(cluster.key_file), _tier_of(cluster, "node-0")
            filler = _fill(small_tmpfs)

            # A peer's replica: its chunk's write fails on the server's own thread.
            sock = connect_dealer(ctx, address, key=key)
            with pytest.raises(TransferError, match="the tier's file system is full") as refused:
                push(sock, CopyKey("other", "checkpoint_000_000001", 1), 1, files, src, address, timeout_s=30)
            sock.close(linger=0)
            assert "node-0" in str(refused.value) and "ENOSPC" in str(refused.value)

            # The same thread answers the next request, with nothing of the replica left, in files or budget.
            listed = ask(ctx, key, address, m.TierList(), timeout_s=30)
            assert listed.copies == [] and listed.used_bytes == 0, listed
            assert not list(cluster.tier_dir.glob("node-0/*/*/*.partial")), list(cluster.tier_dir.rglob("*"))

            # A rank's files copied in: the hold's thread answers with the error too.
            hold = m.TierHold(run="other", checkpoint_dir="checkpoint_000_000001", rank=0, seq=1, files=files,
                              source_dir=str(src))
            stored = ask(ctx, key, address, hold, timeout_s=60)
            assert not stored.ok and "node-0" in stored.reason and "ENOSPC" in stored.reason, stored
            assert "lower `outlast start --checkpoint-memory`" in stored.reason

            filler.unlink()
            stored = ask(ctx, key, address, hold, timeout_s=60)
            assert stored.ok, stored
            assert ask(ctx, key, address, m.TierFree(run="other"), timeout_s=30).rank == -1
        finally:
            ctx.destroy(linger=0)

        # A run kept in memory commits on the same agents.
        fit_counting(storage_path, tmp_path / "events.jsonl", storage="memory")
        state = json.loads((Path(storage_path) / "run" / "run_state.json").read_text())
        assert state["checkpoints"] and all(r["memory_at"] for r in state["checkpoints"]), state["checkpoints"]


# ---- a sender that dies mid-transfer, and sizes it declares ----------------------------------------------


def _offer(ctx, key, address: str, files: list[m.FileEntry]) -> tuple[zmq.Socket, m.TierReply]:
    sock = connect_dealer(ctx, address, key=key)
    sock.send(encode(m.TierOffer(run="run", checkpoint_dir="checkpoint_000_000001", rank=0, seq=1, files=files)))
    assert sock.poll(30_000), "no answer to the offer"
    return sock, TIER_REPLIES.decode(sock.recv())


def _send_chunk(ctx, transfer: m.Transfer, path: str, offset: int, data: bytes) -> m.TierReply:
    data_sock = connect_dealer(ctx, transfer.data_address)
    try:
        chunk = m.TierChunk(run="run", checkpoint_dir="checkpoint_000_000001", rank=0, path=path, offset=offset)
        data_sock.send_multipart(TransferSealer(transfer, ASKER).seal(chunk, data))
        assert data_sock.poll(30_000), "no answer to a chunk"
        return TIER_REPLIES.decode(data_sock.recv_multipart()[0])
    finally:
        data_sock.close(linger=0)


@pytest.fixture
def one_node(monkeypatch, tmp_path):
    monkeypatch.setenv("OUTLAST_TIER_TRANSFER_TIMEOUT_S", "15")  # far past the test's own steps
    with LocalCluster(num_nodes=1, workdir=tmp_path / "cl", node_args=["--checkpoint-memory", "64MiB"]) as cluster:
        ctx = zmq.Context()
        try:
            yield cluster, ctx, ClusterKey.load(cluster.key_file), _tier_of(cluster, "node-0")
        finally:
            ctx.destroy(linger=0)


def test_a_sender_that_dies_mid_transfer_leaves_no_partial_file_and_no_reserved_bytes(one_node, tmp_path):
    cluster, ctx, key, address = one_node
    files = [m.FileEntry(path="model.pt", size=20 * MB, xxh3_128="0" * 32)]
    sock, ack = _offer(ctx, key, address, files)
    assert isinstance(ack, m.TierAck) and ack.transfer is not None, ack
    assert isinstance(_send_chunk(ctx, ack.transfer, "model.pt", 0, os.urandom(8 * MB)), m.TierAck)
    # While it comes in, the copy counts in the budget at its declared size.
    assert ask(ctx, key, address, m.TierList(), timeout_s=30).used_bytes == 20 * MB
    assert list(cluster.tier_dir.glob("node-0/*/*/rank-0.partial"))
    sock.close(linger=0)  # the sender is gone: nothing more comes

    def let_go() -> bool:
        listed = ask(ctx, key, address, m.TierList(), timeout_s=30)
        return listed.used_bytes == 0 and not list(cluster.tier_dir.glob("node-0/*/*/rank-0.partial"))

    wait_until(let_go, 60, "the silent transfer's bytes let go")
    assert "has been silent" in cluster.nodes["node-0"].log_path.read_text()


def test_sizes_a_peer_declares_are_kept_to_and_a_hostile_one_is_refused_up_front(one_node):
    cluster, ctx, key, address = one_node
    for files, said in (([m.FileEntry(path="huge.pt", size=2**62, xxh3_128="0" * 32)], "more than the node's whole"),
                        ([m.FileEntry(path="a.pt", size=-(2**40), xxh3_128="0" * 32),
                          m.FileEntry(path="b.pt", size=2**40 + MB, xxh3_128="0" * 32)], "declares")):
        sock, reply = _offer(ctx, key, address, files)
        sock.close(linger=0)
        assert isinstance(reply, m.TierStored) and not reply.ok and said in reply.reason, reply

    sock, ack = _offer(ctx, key, address, [m.FileEntry(path="model.pt", size=MB, xxh3_128="0" * 32)])
    try:
        past = _send_chunk(ctx, ack.transfer, "model.pt", MB - 10, os.urandom(4 * MB))
        assert isinstance(past, m.TierStored) and "past its declared" in past.reason, past
        # The transfer is over, and what it wrote is gone.
        assert isinstance(_send_chunk(ctx, ack.transfer, "model.pt", 0, b"x"), m.TierStored)
        assert ask(ctx, key, address, m.TierList(), timeout_s=30).used_bytes == 0
        assert not list(cluster.tier_dir.glob("node-0/*/*/rank-0.partial"))
    finally:
        sock.close(linger=0)


# ---- the agent's own loop -------------------------------------------------------------------------------


def test_an_agent_request_naming_no_path_is_answered_with_its_error_and_the_agent_goes_on(tmp_path):
    from outlast.protocol.transport import AGENT_EVENTS

    with LocalCluster(num_nodes=1, workdir=tmp_path / "cl") as cluster:
        ctx = zmq.Context()
        try:
            sock = connect_dealer(ctx, cluster.nodes["node-0"].address, key=ClusterKey.load(cluster.key_file))
            # A path no file system takes: resolving it once raised (ValueError) and ended the agent's loop.
            sock.send(encode(m.ReadOutput(path="/tmp/out\x00put.log", lines=10)))
            assert sock.poll(30_000), "no answer: the agent's loop ended"
            answer = AGENT_EVENTS.decode(sock.recv())
            assert isinstance(answer, m.OutputLines) and not answer.lines and "is not a path" in answer.error, answer
            sock.send(encode(m.Ping()))
            assert sock.poll(30_000) and isinstance(AGENT_EVENTS.decode(sock.recv()), m.Pong)
            assert cluster.nodes["node-0"].proc.poll() is None
        finally:
            ctx.destroy(linger=0)
