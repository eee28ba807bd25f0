"""The memory tier's budget for bytes in flight, what a run's end and an eviction take with them, and a tier
thread that dies: started again, and answering."""

import os
import time
from pathlib import Path

import pytest
import zmq

from outlast.agent.tier_client import ask
from outlast.agent.tier_server import TierServer
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey, start_authenticator
from outlast.storage.local import LocalStorage
from outlast.storage.checksum import hash_file
from outlast.storage.memtier import Copy, CopyKey, TierBook
from outlast.storage.records import Manifest
from outlast.storage.run_store import RunStore
from outlast.storage.tier_restore import restore
from outlast.storage.tier_store import TierStore

MB = 2**20


def _copy(ckpt: str, seq: int, nbytes: int, rank: int = 0) -> Copy:
    return Copy(CopyKey("r", ckpt, rank), seq, nbytes, float(seq))


def test_a_copy_being_written_counts_in_the_budget_until_it_is_kept_or_let_go():
    book = TierBook(100 * MB)
    assert book.begin(_copy("c1", 1, 60 * MB))[0].admit
    assert book.used() == 60 * MB
    # Another copy while the first is in flight: the bytes in flight are not room.
    refused, _ = book.begin(_copy("c2", 2, 60 * MB, rank=1))
    assert not refused.admit and "--checkpoint-memory" in refused.reason
    assert book.finish(_copy("c1", 1, 60 * MB))[0].admit and book.used() == 60 * MB
    assert book.begin(_copy("c3", 3, 30 * MB))[0].admit and book.used() == 90 * MB
    book.abort(CopyKey("r", "c3", 0))  # its transfer died
    assert book.used() == 60 * MB


def test_a_copy_being_written_is_not_begun_again_by_a_second_writer():
    book = TierBook(100 * MB)
    assert book.begin(_copy("c1", 1, 10 * MB))[0].admit
    again, _ = book.begin(_copy("c1", 1, 10 * MB))
    assert not again.admit and "being written already" in again.reason
    assert book.used() == 10 * MB


def test_a_negative_declared_size_is_refused_before_anything_is_written(tmp_path):
    s = TierStore(tmp_path / "tier", "n1", 64 * MB)
    s.open()
    files = [m.FileEntry(path="a", size=-(2**40), xxh3_128="0" * 32),
             m.FileEntry(path="b", size=2**40 + 1, xxh3_128="0" * 32)]
    admission, partial = s.begin("r", "c1", 0, 1, files)
    assert partial is None and not admission.admit and "declares" in admission.reason
    assert s.book.used() == 0 and not list((tmp_path / "tier" / "n1").glob("*/*/*.partial"))


# ---- restore links ---------------------------------------------------------------------------------------


def _held_and_restored(tmp_path: Path, s: TierStore, name: str, seq: int) -> Path:
    """A copy of checkpoint `name` held on n1, with a manifest in storage, restored from memory: its links."""
    storage = LocalStorage(tmp_path / "storage")
    src = tmp_path / name
    src.mkdir()
    (src / "model.pt").write_bytes(os.urandom(MB))
    entries = [m.FileEntry(path="model.pt", size=MB, xxh3_128=hash_file(src / "model.pt")[1])]
    assert s.put_dir(storage.uri("run"), name, 0, seq, entries, src) is None
    RunStore(storage, "run").write_manifest(Manifest(checkpoint_dir=name, seq=seq, attempt=0, report_index=seq,
                                                     committed_at=1.0, ranks=[0], files=entries))
    path, _source, _said = restore(storage, "run", name, tmp_path / "cache", "n1", s.root)
    assert path.is_relative_to(s.home / "restores")
    return path


def test_freeing_a_run_takes_the_links_its_restores_made_with_its_copies(tmp_path):
    s = TierStore(tmp_path / "tier", "n1", 64 * MB)
    s.open()
    linked = _held_and_restored(tmp_path, s, "checkpoint_000_000001", 1)
    s.free_run(LocalStorage(tmp_path / "storage").uri("run"))
    assert not linked.exists()
    assert [p for p in s.home.rglob("*") if p.name != "owner.json" and p != s.home / "restores"] == []


def test_an_evicted_copy_takes_its_restore_links_with_it(tmp_path):
    # Room for one copy: the second evicts the first, whose restore's links would keep its bytes outside the budget.
    s = TierStore(tmp_path / "tier", "n1", MB + MB // 2)
    s.open()
    first = _held_and_restored(tmp_path, s, "checkpoint_000_000001", 1)
    src = tmp_path / "second"
    src.mkdir()
    (src / "model.pt").write_bytes(os.urandom(MB))
    entries = [m.FileEntry(path="model.pt", size=MB, xxh3_128=hash_file(src / "model.pt")[1])]
    assert s.put_dir(LocalStorage(tmp_path / "storage").uri("run"), "checkpoint_000_000002", 0, 2, entries, src) is None
    assert not first.exists()
    # What the tier's files take: the second copy alone.
    inodes = {p.stat().st_ino: p.stat().st_size for p in s.home.rglob("*.pt")}
    assert sum(inodes.values()) == MB


# ---- a thread that dies ----------------------------------------------------------------------------------


class _Bug(BaseException):
    """Past every guard of a request (those catch Exception)."""


def test_a_tier_thread_that_dies_is_started_again_and_answers_the_next_request(tmp_path, monkeypatch):
    ctx = zmq.Context()
    key = ClusterKey.generate()
    auth = start_authenticator(ctx, key)
    s = TierStore(tmp_path / "tier", "n1", 64 * MB)
    s.open()
    server = TierServer(ctx, key, s).start()
    try:
        real_pull = server.work.pull
        died = []

        def pull_once_dies(pull, asked_at):
            if not died:
                died.append(True)
                raise _Bug("a bug")
            return real_pull(pull, asked_at)

        monkeypatch.setattr(server.work, "pull", pull_once_dies)
        pull = m.TierPull(run="r", checkpoint_dir="c1", rank=0, from_address=server.address)
        with pytest.raises(Exception, match="no answer"):
            ask(ctx, key, server.address, pull, timeout_s=2)
        deadline = time.monotonic() + 30
        said: list[str] = []
        while not said and time.monotonic() < deadline:
            said = server.watch()
            time.sleep(0.05)
        assert said == ["the memory tier's thread outlast-tier-waited died (_Bug: a bug); started it again"]
        # The same request again, on the thread started in its place: answered (nothing is held to pull).
        answer = ask(ctx, key, server.address, pull, timeout_s=30)
        assert isinstance(answer, m.TierStored) and not answer.ok and "is not held on n1" in answer.reason, answer
    finally:
        server.stop()
        auth.stop()
        ctx.term()
