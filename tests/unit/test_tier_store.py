"""The memory tier on its files and between two tier servers over CURVE with the cluster key."""

import contextlib
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from outlast.agent.tier_client import CHUNK, TransferError, ask, fetch
from outlast.agent.tier_server import TierServer
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey, start_authenticator
from outlast.protocol.transport import TIER_REPLIES, TIER_REQUESTS, connect_dealer, encode
from outlast.storage.checksum import hash_file
from outlast.storage.memtier import CopyKey
from outlast.storage.tier_store import TierStore, copy_dir

MB = 2**20


def rot(path: Path, n: int = 1) -> None:
    """Change a file's first `n` bytes, keeping its size: each byte flipped, so it differs whatever it was
    (a fixed byte written over random ones left the file whole once in 256 runs)."""
    with open(path, "r+b") as f:
        head = f.read(n)
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in head))


def write_files(where: Path, sizes: dict[str, int]) -> list[m.FileEntry]:
    out = []
    for name, size in sizes.items():
        path = where / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        out.append(m.FileEntry(path=name, size=size, xxh3_128=hash_file(path)[1]))
    return out


@pytest.fixture
def root(tmp_path):
    return tmp_path / "tier"


def store(root, node="n1", budget=64 * MB, clock=None):
    s = TierStore(root, node, budget, clock=clock or time.time)
    s.open()
    return s


def test_a_copy_is_kept_whole_and_read_in_place(root, tmp_path):
    files = write_files(tmp_path / "ckpt", {"model.pt": 3 * MB, "sub/opt.pt": 1})
    s = store(root)
    assert s.put_dir("run", "checkpoint_000_000001", 0, 1, files, tmp_path / "ckpt") is None
    key = CopyKey("run", "checkpoint_000_000001", 0)
    assert s.path(key) == copy_dir(root, "n1", key)
    assert (s.path(key) / "sub/opt.pt").read_bytes() == (tmp_path / "ckpt/sub/opt.pt").read_bytes()
    assert s.verify(key) is None and s.book.used() == 3 * MB + 1


def test_files_that_differ_from_what_was_reported_are_not_kept(root, tmp_path):
    files = write_files(tmp_path / "ckpt", {"a": 1000})
    (tmp_path / "ckpt/a").write_bytes(os.urandom(1000))  # rewritten after its checksum was taken
    s = store(root)
    why = s.put_dir("run", "c1", 0, 1, files, tmp_path / "ckpt")
    assert "does not match its checksum" in why and s.records() == [] and s.book.used() == 0


def test_a_corrupted_copy_is_dropped_at_its_check(root, tmp_path):
    files = write_files(tmp_path / "ckpt", {"a": 1000})
    s = store(root)
    s.put_dir("run", "c1", 0, 1, files, tmp_path / "ckpt")
    key = CopyKey("run", "c1", 0)
    rot(s.path(key) / "a")
    assert "does not match its checksum" in s.verify(key)
    assert s.path(key) is None and not copy_dir(root, "n1", key).exists()


def test_the_budget_evicts_the_oldest_and_keeps_the_newest_committed_copy(root, tmp_path):
    files = write_files(tmp_path / "ckpt", {"a": 10 * MB})
    now = iter(range(100))
    s = store(root, budget=25 * MB, clock=lambda: float(next(now)))
    s.put_dir("run", "c1", 0, 1, files, tmp_path / "ckpt")
    s.mark_committed("run", "c1")
    s.put_dir("run", "c2", 0, 2, files, tmp_path / "ckpt")  # pending: c1 stays the newest committed
    assert s.put_dir("run", "c3", 0, 3, files, tmp_path / "ckpt") is None
    assert [r.checkpoint_dir for r in s.records()] == ["c1", "c3"]
    assert not copy_dir(root, "n1", CopyKey("run", "c2", 0)).exists()
    s.mark_committed("run", "c3")
    s.put_dir("run", "c4", 0, 4, files, tmp_path / "ckpt")
    assert [r.checkpoint_dir for r in s.records()] == ["c3", "c4"]


def test_a_restarted_agent_reclaims_its_whole_copies_and_drops_the_rest(root, tmp_path):
    files = write_files(tmp_path / "ckpt", {"a": 2 * MB})
    s = store(root)
    s.put_dir("run", "c1", 0, 1, files, tmp_path / "ckpt")
    s.put_dir("run", "c2", 0, 2, files, tmp_path / "ckpt")
    s.mark_committed("run", "c2")
    os.truncate(s.path(CopyKey("run", "c1", 0)) / "a", 5)  # torn by the crash
    partial = copy_dir(root, "n1", CopyKey("run", "c3", 0)).with_name("rank-0.partial")
    partial.mkdir(parents=True)
    again = TierStore(root, "n1", 64 * MB)
    said = again.open()
    assert [(r.checkpoint_dir, r.committed) for r in again.records()] == [("c2", True)]
    assert any("not whole" in line and "c1" in line for line in said)
    assert not partial.exists() and again.book.used() == 2 * MB


def test_the_tier_of_an_agent_that_is_gone_is_freed_and_a_live_ones_kept(root, tmp_path):
    files = write_files(tmp_path / "ckpt", {"a": 1 * MB})
    live = store(root, node="live")
    live.put_dir("run", "c1", 0, 1, files, tmp_path / "ckpt")
    child = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from pathlib import Path
from outlast.storage.tier_store import TierStore
TierStore(Path({str(root)!r}), sys.argv[1], 1 << 30).open()
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
""", "dead", "0"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n" and child.wait() == 0
    said = TierStore(root, "n9", 64 * MB).open()
    assert any("node dead" in line for line in said)
    assert not (root / "dead").exists() and (root / "live").exists()


@pytest.fixture
def pair(root):
    ctx = zmq.Context()
    key = ClusterKey.generate()
    auth = start_authenticator(ctx, key)
    servers = [TierServer(ctx, key, store(root, node=f"n{i}", budget=64 * MB)).start() for i in (1, 2)]
    yield ctx, key, servers
    for s in servers:
        s.stop()
    auth.stop()
    ctx.term()


def test_a_hold_keeps_the_files_on_the_node_and_a_replica_on_the_peer(pair, tmp_path):
    ctx, key, (a, b) = pair
    files = write_files(tmp_path / "ckpt", {"model.pt": 2 * CHUNK + 5, "empty": 0})
    hold = m.TierHold(run="run", checkpoint_dir="c1", rank=3, seq=1, files=files,
                      source_dir=str(tmp_path / "ckpt"), peer_address=b.address)
    stored = ask(ctx, key, a.address, hold)
    assert stored.ok and stored.node_id == "n1" and stored.replica_node == "n2", stored
    copy = CopyKey("run", "c1", 3)
    assert b.store.verify(copy) is None and a.store.verify(copy) is None
    assert b.store.record(copy).primary is False
    fetched, digests = fetch(ctx, key, b.address, copy, tmp_path / "back")
    assert fetched.files == files
    # Every file came in order, so its checksum was computed as it was written, an empty one too.
    assert digests == {f.path: f.xxh3_128 for f in files}
    assert (tmp_path / "back/model.pt").read_bytes() == (tmp_path / "ckpt/model.pt").read_bytes()
    listed = ask(ctx, key, b.address, m.TierList())
    assert [(c.checkpoint_dir, c.rank, c.primary) for c in listed.copies] == [("c1", 3, False)]


def test_a_draining_nodes_hold_links_the_ranks_files_and_copies_those_on_another_file_system(pair, tmp_path):
    ctx, key, (a, b) = pair
    here = a.store.root.parent / "rank-dir"  # the tier's file system
    files = write_files(here, {"model.pt": CHUNK + 3, "step.json": 10})
    hold = m.TierHold(run="run", checkpoint_dir="c1", rank=0, seq=1, files=files, source_dir=str(here),
                      peer_address=b.address, link=True)
    stored = ask(ctx, key, a.address, hold)
    assert stored.ok and stored.replica_node == "n2", stored
    copy = CopyKey("run", "c1", 0)
    held = copy_dir(a.store.root, "n1", copy)
    assert all((held / f.path).stat().st_ino == (here / f.path).stat().st_ino for f in files)
    assert a.store.verify(copy) is None and b.store.verify(copy) is None
    # The rank's directory removed (its report returned): the linked copy is still whole, and still checked.
    for f in files:
        (here / f.path).unlink()
    assert a.store.verify(copy) is None
    rot(held / "model.pt")
    assert "does not match its checksum" in a.store.verify(copy)

    # Where the rank's files are on another file system than the tier (/dev/shm), they are copied.
    other = next(d for d in ("/dev/shm", "/var/tmp", "/tmp") if os.stat(d).st_dev != os.stat(a.store.root).st_dev)
    elsewhere = Path(tempfile.mkdtemp(dir=other))
    try:
        files = write_files(elsewhere, {"model.pt": 100})
        stored = ask(ctx, key, a.address, msgspec.structs.replace(hold, checkpoint_dir="c2", files=files,
                                                                  source_dir=str(elsewhere)))
        assert stored.ok, stored
        held = copy_dir(a.store.root, "n1", CopyKey("run", "c2", 0))
        assert (held / "model.pt").read_bytes() == (elsewhere / "model.pt").read_bytes()
        assert os.stat(held / "model.pt").st_dev != os.stat(elsewhere / "model.pt").st_dev
    finally:
        shutil.rmtree(elsewhere)


@contextlib.contextmanager
def replica_asked(ctx, key, server, peer, checkpoint_dir, seq, files):
    """The replica of a copy `server` holds already (as beside a durable commit), asked without waiting:
    the socket its answer comes to."""
    sock = connect_dealer(ctx, server.address, key=key)
    try:
        sock.send(encode(m.TierHold(run="run", checkpoint_dir=checkpoint_dir, rank=0, seq=seq, files=files,
                                    source_dir="", peer_address=peer.address)))
        yield sock
    finally:
        sock.close(linger=0)


def answer_to(sock):
    assert sock.poll(30_000)
    return TIER_REPLIES.decode(sock.recv())


def test_a_draining_node_holds_replicas_beside_durable_commits_back_until_the_drains_checkpoint_is_held(pair,
                                                                                                       tmp_path):
    ctx, key, (a, b) = pair
    old = write_files(tmp_path / "old", {"model.pt": 3 * MB})
    a.store.put_dir("run", "c0", 0, 1, old, tmp_path / "old")
    a.drain(time.time() + 60)
    with replica_asked(ctx, key, a, b, "c0", 1, old) as background:
        assert not background.poll(1000)  # it waits while the node drains
        new = write_files(tmp_path / "new", {"model.pt": 2 * MB})
        stored = ask(ctx, key, a.address, m.TierHold(run="run", checkpoint_dir="c1", rank=0, seq=2, files=new,
                                                      source_dir=str(tmp_path / "new"), peer_address=b.address))
        assert stored.ok and stored.replica_node == "n2", stored
        # The drain's checkpoint is on both nodes: the replica held back goes now.
        replica = answer_to(background)
        assert replica.ok and replica.checkpoint_dir == "c0" and replica.replica_node == "n2", replica
    # A drain whose checkpoint never comes holds them back until its deadline only.
    a.store.put_dir("run", "c2", 0, 3, old, tmp_path / "old")
    a.drain(time.time() + 1.5)
    with replica_asked(ctx, key, a, b, "c2", 3, old) as background:
        assert not background.poll(500)
        replica = answer_to(background)
        assert replica.ok and replica.checkpoint_dir == "c2" and replica.replica_node == "n2", replica


def test_a_replica_the_peer_cannot_fit_is_said_and_the_local_copy_stays(pair, tmp_path):
    ctx, key, (a, b) = pair
    b.store.book.budget_bytes = 1 * MB
    files = write_files(tmp_path / "ckpt", {"a": 2 * MB})
    stored = ask(ctx, key, a.address, m.TierHold(run="run", checkpoint_dir="c1", rank=0, seq=1, files=files,
                                                  source_dir=str(tmp_path / "ckpt"), peer_address=b.address))
    assert stored.ok and stored.replica_node == "" and "--checkpoint-memory" in stored.replica_reason


def test_a_replica_whose_bytes_differ_from_its_record_is_refused_by_the_peer(pair, tmp_path):
    from outlast.agent.tier_client import push

    ctx, key, (_a, b) = pair
    files = write_files(tmp_path / "ckpt", {"model.pt": 2 * CHUNK + 5})
    (tmp_path / "ckpt/model.pt").write_bytes(os.urandom(2 * CHUNK + 5))  # changed since its checksum was taken
    sock = connect_dealer(ctx, b.address, key=key)
    try:
        stored = push(sock, CopyKey("run", "c1", 0), 1, files, tmp_path / "ckpt", b.address)
    finally:
        sock.close(linger=0)
    assert not stored.ok and "does not match its checksum" in stored.reason, stored
    assert b.store.records() == [] and b.store.book.used() == 0


def test_a_peer_without_the_cluster_key_gets_nothing(pair, tmp_path):
    ctx, _key, (a, _b) = pair
    with pytest.raises(TransferError, match="no answer"):
        ask(ctx, ClusterKey.generate(), a.address, m.TierList(), timeout_s=1.0)


def test_fetching_a_copy_that_is_not_held_says_so(pair, tmp_path):
    ctx, key, (a, _b) = pair
    with pytest.raises(TransferError, match="not held on n1"):
        fetch(ctx, key, a.address, CopyKey("run", "nope", 0), tmp_path / "x")


# -- restores from the tier -------------------------------------------------------------------------

from outlast.storage.local import LocalStorage  # noqa: E402
from outlast.storage.memtier import SourceKind  # noqa: E402
from outlast.storage.records import Manifest  # noqa: E402
from outlast.storage.restore import CorruptCheckpointError  # noqa: E402
from outlast.storage.run_store import RunStore  # noqa: E402
from outlast.storage.tier_restore import restore  # noqa: E402

NAME = "checkpoint_000_000002"


def committed(tmp_path, root, ranks: dict[int, dict[str, bytes]], upload=True):
    """Ranks' files held on node n1's tier and (with `upload`) in storage, with a manifest over them all."""
    storage = LocalStorage(tmp_path / "storage")
    s = store(root, budget=1 << 30)
    merged = {}
    for rank, files in ranks.items():
        src = tmp_path / f"rank{rank}"
        for rel, data in files.items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(data)
        entries = [m.FileEntry(path=rel, size=len(d), xxh3_128=hash_file(src / rel)[1]) for rel, d in files.items()]
        assert s.put_dir(storage.uri("run"), NAME, rank, 2, entries, src) is None
        if upload:
            storage.upload_dir(src, f"run/{NAME}")
        for e in entries:
            merged.setdefault(e.path, e)
    RunStore(storage, "run").write_manifest(Manifest(checkpoint_dir=NAME, seq=2, attempt=0, report_index=2,
                                                     committed_at=1.0, ranks=sorted(ranks),
                                                     files=list(merged.values())))
    return storage, s


def test_a_restore_reads_every_ranks_files_from_memory_when_all_are_here(tmp_path, root):
    storage, _ = committed(tmp_path, root, {0: {"model.pt": os.urandom(3000)}, 1: {"shard1.pt": os.urandom(10)}},
                           upload=False)
    path, source, said = restore(storage, "run", NAME, tmp_path / "cache", "n1", root)
    assert source is SourceKind.LOCAL_MEMORY and said == []
    assert sorted(p.name for p in path.iterdir()) == ["model.pt", "shard1.pt"]
    assert str(path).startswith(str(root / "n1"))


def test_a_corrupted_copy_in_memory_is_skipped_for_another_whole_copy(tmp_path, root):
    same = os.urandom(4000)
    storage, s = committed(tmp_path, root, {0: {"model.pt": same}, 1: {"model.pt": same}}, upload=False)
    rot(s.path(CopyKey(storage.uri("run"), NAME, 0)) / "model.pt", 3)
    path, source, said = restore(storage, "run", NAME, tmp_path / "cache", "n1", root)
    assert source is SourceKind.LOCAL_MEMORY and (path / "model.pt").read_bytes() == same
    assert len(said) == 1 and "rank 0" in said[0] and "checksum" in said[0]


def test_a_corrupted_only_copy_in_memory_is_skipped_for_storage(tmp_path, root):
    data = os.urandom(4000)
    storage, s = committed(tmp_path, root, {0: {"model.pt": data}})
    os.truncate(s.path(CopyKey(storage.uri("run"), NAME, 0)) / "model.pt", 10)
    path, source, said = restore(storage, "run", NAME, tmp_path / "cache", "n1", root)
    assert source is SourceKind.STORAGE and (path / "model.pt").read_bytes() == data
    assert "has 10 bytes" in said[0] and "no whole copy in memory" in said[-1]


def test_a_memory_only_checkpoint_whose_copies_are_all_bad_cannot_be_restored_and_says_why(tmp_path, root):
    storage, s = committed(tmp_path, root, {0: {"model.pt": os.urandom(100)}}, upload=False)
    (s.path(CopyKey(storage.uri("run"), NAME, 0)) / "model.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match="gone from storage|missing"):
        restore(storage, "run", NAME, tmp_path / "cache", "n1", root)


def test_a_node_that_holds_nothing_restores_from_storage(tmp_path, root):
    storage, _ = committed(tmp_path, root, {0: {"model.pt": b"x" * 50}})
    _path, source, said = restore(storage, "run", NAME, tmp_path / "cache", "n2", root)
    assert source is SourceKind.STORAGE and "no whole copy in memory on n2" in said[0]


def test_ranks_of_a_node_restoring_at_once_share_one_directory_that_stays_whole(tmp_path, root):
    from concurrent.futures import ProcessPoolExecutor

    data = os.urandom(2 * MB)
    storage, _ = committed(tmp_path, root, {0: {"model.pt": data}}, upload=False)
    with ProcessPoolExecutor(4) as pool:
        paths = list(pool.map(_restore_and_read, [(str(tmp_path), str(root))] * 8))
    assert len(set(p for p, _ in paths)) == 1 and all(ok for _, ok in paths)


def _restore_and_read(args):
    tmp_path, root = map(Path, args)
    storage = LocalStorage(tmp_path / "storage")
    path, source, _ = restore(storage, "run", NAME, tmp_path / "cache", "n1", root)
    return str(path), source is SourceKind.LOCAL_MEMORY and (path / "model.pt").stat().st_size == 2 * MB


# -- the node's budget as it is set --------------------------------------------------------------------

from outlast.agent.__main__ import add_cluster_arguments, spec_from_args  # noqa: E402
from outlast.isolation.errors import BadSetting  # noqa: E402
from outlast.isolation.reservations import GiB, MIN_USER_MEMORY, compute_reservations  # noqa: E402
from outlast.isolation.reservations import default_checkpoint_memory  # noqa: E402


def _spec(tmp_path, *argv):
    import argparse

    p = argparse.ArgumentParser()
    add_cluster_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    return spec_from_args(p.parse_args(["--cluster-key", str(tmp_path / "k"), *argv]))


def test_checkpoint_memory_not_given_is_left_to_fit_the_node_and_takes_units(tmp_path):
    assert _spec(tmp_path).checkpoint_memory is None
    assert _spec(tmp_path, "--checkpoint-memory", "512MiB").checkpoint_memory == 512 * MB
    assert _spec(tmp_path, "--checkpoint-memory", "0").checkpoint_memory == 0


def test_a_checkpoint_memory_that_is_not_a_size_says_so(tmp_path):
    with pytest.raises(ValueError, match="--checkpoint-memory"):
        _spec(tmp_path, "--checkpoint-memory", "lots")


def test_with_isolation_the_checkpoint_memory_is_reserved_beside_the_systems():
    res = compute_reservations(16 * GiB, None, 8.0, reserved_memory=1 * GiB, checkpoint_memory=3 * GiB)
    assert res.system_memory == 4 * GiB and res.user_memory == 12 * GiB
    assert "of checkpoint memory (--checkpoint-memory)" in res.reason
    with pytest.raises(BadSetting, match="lower --checkpoint-memory"):
        compute_reservations(4 * GiB, None, 8.0, reserved_memory=1 * GiB, checkpoint_memory=3 * GiB)


def test_the_default_budget_is_two_gib_or_an_eighth_of_a_smaller_node():
    assert default_checkpoint_memory(16 * GiB) == 2 * GiB  # where the eighth reaches 2 GiB
    assert default_checkpoint_memory(512 * GiB) == 2 * GiB
    assert default_checkpoint_memory(16 * GiB - 8 * MB) == (16 * GiB - 8 * MB) // 8
    assert default_checkpoint_memory(1536 * MB) == 192 * MB


def test_with_isolation_the_default_budget_fits_a_small_node_and_is_reserved():
    res = compute_reservations(1536 * MB, None, 2.0, reserved_memory=512 * MB, checkpoint_memory=None)
    assert res.checkpoint_memory == 192 * MB and res.system_memory == 704 * MB and res.user_memory == 832 * MB
    assert "192 MiB of checkpoint memory (default: 2 GiB, at most an eighth" in res.reason
    big = compute_reservations(64 * GiB, None, 8.0, checkpoint_memory=None)
    assert big.checkpoint_memory == 2 * GiB and big.system_memory == int(6.4 * GiB) + 2 * GiB


def test_the_default_budget_shrinks_to_leave_the_workloads_their_least_and_never_refuses():
    # 600 MiB: the system's 500 MiB leaves 100; an eighth (75 MiB) would leave 25, under the least.
    res = compute_reservations(600 * MB, None, 2.0, checkpoint_memory=None)
    assert res.user_memory == MIN_USER_MEMORY and res.checkpoint_memory == 100 * MB - MIN_USER_MEMORY
    # All that is left to workloads is their least: no tier, and still a node.
    res = compute_reservations(564 * MB, None, 2.0, checkpoint_memory=None)
    assert res.checkpoint_memory == 0 and res.user_memory == MIN_USER_MEMORY
    # A system reservation that does not fit alone is refused for what it is.
    with pytest.raises(BadSetting, match="lower --system-reserved-memory or give the node more memory"):
        compute_reservations(1 * GiB, None, 2.0, reserved_memory=1 * GiB, checkpoint_memory=None)


def test_an_explicit_budget_that_does_not_fit_is_still_refused():
    with pytest.raises(BadSetting, match="2.00 GiB of it checkpoint memory.*lower --checkpoint-memory"):
        compute_reservations(1536 * MB, None, 2.0, reserved_memory=512 * MB, checkpoint_memory=2 * GiB)


def test_the_agents_tier_takes_the_reserved_budget_with_isolation_else_the_given_or_fitted_one():
    from outlast.agent.agent import tier_budget

    res = compute_reservations(1536 * MB, None, 2.0, reserved_memory=512 * MB, checkpoint_memory=None)
    assert tier_budget(None, res, 64 * GiB) == 192 * MB  # the node's cgroup, not the machine, sets it
    assert tier_budget(None, None, 1536 * MB) == 192 * MB
    assert tier_budget(None, None, 64 * GiB) == 2 * GiB
    assert tier_budget(5 * MB, None, 1536 * MB) == 5 * MB and tier_budget(0, None, 64 * GiB) == 0


def test_a_budget_larger_than_the_tmpfs_is_refused_saying_what_to_do(tmp_path):
    from outlast.agent.tier_server import start_tier

    with pytest.raises(ValueError, match="more than the whole of the file system.*OUTLAST_TIER_DIR"):
        start_tier(zmq.Context.instance(), None, "n1", "127.0.0.1", 1 << 60, root=tmp_path / "tier")


def test_the_default_budget_shrinks_to_half_a_small_tmpfs_instead_of_refusing_the_node(tmp_path):
    import shutil

    from outlast.agent.tier_server import start_tier

    server = start_tier(zmq.Context.instance(), None, "n1", "127.0.0.1", 1 << 60, root=tmp_path / "tier", fitted=True)
    try:
        assert server.store.book.budget_bytes == shutil.disk_usage(tmp_path).total // 2
    finally:
        server.stop()


def test_a_second_live_agent_of_the_same_node_id_cannot_take_its_tier(root):
    child = subprocess.Popen([sys.executable, "-c", f"""
import time
from pathlib import Path
from outlast.storage.tier_store import TierStore
TierStore(Path({str(root)!r}), "n1", 1 << 30).open()
print("ready", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        with pytest.raises(ValueError, match=f"belongs to pid {child.pid}, which still runs"):
            TierStore(root, "n1", 1 << 30).open()
    finally:
        child.kill()
        child.wait()
    TierStore(root, "n1", 1 << 30).open()  # once it is gone, the node's next agent takes it


def test_a_pull_brings_a_peers_copy_into_this_nodes_tier_checked(pair, tmp_path):
    ctx, key, (a, b) = pair
    files = write_files(tmp_path / "ckpt", {"model.pt": CHUNK + 7})
    a.store.put_dir("run", "c1", 0, 1, files, tmp_path / "ckpt")
    stored = ask(ctx, key, b.address, m.TierPull(run="run", checkpoint_dir="c1", rank=0, from_address=a.address))
    assert stored.ok and stored.node_id == "n2" and stored.nbytes == CHUNK + 7, stored
    assert b.store.verify(CopyKey("run", "c1", 0)) is None
    missing = ask(ctx, key, b.address, m.TierPull(run="run", checkpoint_dir="c9", rank=0, from_address=a.address))
    assert not missing.ok and "not held on n1" in missing.reason
    assert b.store.records()[0].checkpoint_dir == "c1" and len(b.store.records()) == 1


def test_a_pull_to_a_node_whose_own_copy_rotted_fetches_the_peers_whole_one(pair, tmp_path):
    ctx, key, (a, b) = pair
    files = write_files(tmp_path / "ckpt", {"model.pt": 1000})
    for server in (a, b):
        server.store.put_dir("run", "c1", 0, 1, files, tmp_path / "ckpt")
    copy = CopyKey("run", "c1", 0)
    rot(copy_dir(b.store.root, "n2", copy) / "model.pt")  # same size, another checksum: a restore there skips it
    stored = ask(ctx, key, b.address, m.TierPull(run="run", checkpoint_dir="c1", rank=0, from_address=a.address))
    assert stored.ok and stored.reason != "already held", stored
    assert b.store.verify(copy) is None


def test_a_chunk_is_sealed_from_the_file_and_opens_only_as_it_was_sent_in_its_own_transfer(tmp_path):
    from outlast.agent.tier_client import ASKER, SERVER, TransferSealer, file_view, new_transfer

    payload = os.urandom(MB)
    (tmp_path / "f").write_bytes(b"x" * MB + payload + b"y" * MB)
    view = file_view(tmp_path, "f")
    assert isinstance(view.obj, mmap.mmap)
    transfer = new_transfer("tcp://127.0.0.1:1")
    sender, receiver = TransferSealer(transfer, ASKER), TransferSealer(transfer, SERVER)
    chunk = m.TierChunk(run="r", checkpoint_dir="c", rank=0, path="f", offset=MB)
    head, sealed = sender.seal(chunk, view[MB:2 * MB])
    assert len(head) < 200 and len(sealed) == MB + 16 and payload[:64] not in sealed  # the bytes travel encrypted
    sent = TIER_REQUESTS.decode(head)
    assert sent.session == transfer.session and sent.nonce == 1
    assert receiver.open(head, sent, sealed) == payload
    # A changed byte, a header that moves the chunk elsewhere, another transfer's key, and a chunk sent back to
    # its own sender: none opens.
    flipped = bytearray(sealed)
    flipped[5] ^= 1
    moved = encode(msgspec.structs.replace(sent, offset=0))
    for opener, h, c, data in ((receiver, head, sent, bytes(flipped)),
                               (receiver, moved, TIER_REQUESTS.decode(moved), sealed),
                               (TransferSealer(new_transfer("tcp://127.0.0.1:1"), SERVER), head, sent, sealed),
                               (sender, head, sent, sealed)):
        with pytest.raises(TransferError, match="failed its seal"):
            opener.open(h, c, data)
    # Each seal takes a nonce of its own.
    assert TIER_REQUESTS.decode(sender.seal(chunk, b"z")[0]).nonce == 2
    (tmp_path / "empty").write_bytes(b"")
    assert len(file_view(tmp_path, "empty")) == 0


def test_the_data_socket_serves_no_chunk_outside_a_transfer_the_server_opened(pair, tmp_path):
    ctx, key, (a, _b) = pair
    files = write_files(tmp_path / "ckpt", {"model.pt": 1000})
    a.store.put_dir("run", "c1", 0, 1, files, tmp_path / "ckpt")
    assert a.data_address != a.address
    sock = connect_dealer(ctx, a.data_address)  # no cluster key: the data socket has none
    try:
        for session in (b"", os.urandom(16)):
            sock.send(encode(m.TierFetch(run="run", checkpoint_dir="c1", rank=0, path="model.pt", length=1000,
                                         session=session)))
            assert sock.poll(5000)
            reply = TIER_REPLIES.decode(sock.recv_multipart()[0])
            assert isinstance(reply, m.TierStored) and not reply.ok and "no transfer" in reply.reason, reply
        sock.send(encode(m.TierList()))  # only chunks are asked there: nothing else is answered
        assert not sock.poll(500)
    finally:
        sock.close(linger=0)
    # A frame larger than a sealed chunk ends the stranger's connection before it is read.
    sock = connect_dealer(ctx, a.data_address)
    try:
        sock.send_multipart([encode(m.TierFetch(run="run", checkpoint_dir="c1", rank=0, path="model.pt", length=1000,
                                                session=b"x" * 16)), b"\0" * (CHUNK + (1 << 20))])
        assert not sock.poll(1000)
    finally:
        sock.close(linger=0)
    # The record asked over the CURVE socket opens a transfer, and its chunks come back through the data socket.
    fetched, _ = fetch(ctx, key, a.address, CopyKey("run", "c1", 0), tmp_path / "back")
    assert fetched.transfer is not None and fetched.transfer.data_address == a.data_address
    assert (tmp_path / "back/model.pt").read_bytes() == (tmp_path / "ckpt/model.pt").read_bytes()


def test_a_fetch_is_served_from_sealing_buffers_used_again_and_asks_no_more_than_a_chunk(pair, tmp_path):
    ctx, key, (a, _b) = pair
    # More chunks than the ring has buffers, twice over: each buffer is sealed into again once zmq sent it.
    files = write_files(tmp_path / "ckpt", {"model.pt": 6 * CHUNK + 12345, "small": 10})
    a.store.put_dir("run", "c1", 0, 1, files, tmp_path / "ckpt")
    for n in range(2):
        fetched, digests = fetch(ctx, key, a.address, CopyKey("run", "c1", 0), tmp_path / f"back{n}")
        for f in files:
            assert (tmp_path / f"back{n}" / f.path).read_bytes() == (tmp_path / "ckpt" / f.path).read_bytes()
            assert digests[f.path] == f.xxh3_128  # taken as the chunks were written
    # Within a transfer, a fetch of more than a chunk, or from before the file's start, is refused.
    offer = ask(ctx, key, a.address, m.TierFetch(run="run", checkpoint_dir="c1", rank=0))
    assert isinstance(offer, m.TierOffer) and offer.transfer is not None
    sock = connect_dealer(ctx, offer.transfer.data_address)
    try:
        for offset, length in ((0, CHUNK + 1), (-1, 10)):
            sock.send(encode(m.TierFetch(run="run", checkpoint_dir="c1", rank=0, path="model.pt", offset=offset,
                                         length=length, session=offer.transfer.session)))
            assert sock.poll(5000)
            reply = TIER_REPLIES.decode(sock.recv_multipart()[0])
            assert isinstance(reply, m.TierStored) and not reply.ok and "at most" in reply.reason, reply
    finally:
        sock.close(linger=0)
