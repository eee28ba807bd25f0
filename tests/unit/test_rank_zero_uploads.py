"""Ranks sharing a checkpoint directory on a file system: rank 0 replaces a file, the others only
create one that is absent, so storage holds rank 0's copy whatever the order of the uploads."""

import os
import threading

import pytest
import xxhash

from outlast.storage.local import LocalStorage


@pytest.fixture
def store(tmp_path):
    return LocalStorage(tmp_path / "root")


def _rank_dir(tmp_path, rank, extra=None):
    d = tmp_path / f"rank{rank}"
    d.mkdir()
    (d / "model.pt").write_bytes(f"rank {rank} weights".encode() * 100)
    for name, data in (extra or {}).items():
        (d / name).write_bytes(data)
    return d


def _leftovers(store, dest):
    return sorted(p.name for p in store.local_path(dest).iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("move", [False, True])
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_the_stored_copy_is_rank_zeros_whatever_the_order(store, tmp_path, move, order):
    dirs = {rank: _rank_dir(tmp_path, rank, {f"rank{rank}.pt": b"own"}) for rank in (0, 1)}
    for rank in order:
        store.upload_dir(dirs[rank], "run/c", move=move, replace=rank == 0)
    assert store.read_bytes("run/c/model.pt") == (dirs[0] / "model.pt").read_bytes()
    assert store.read_bytes("run/c/rank1.pt") == store.read_bytes("run/c/rank0.pt") == b"own"
    assert _leftovers(store, "run/c") == []  # no temporary names left behind


def test_a_rank_that_does_not_replace_reports_its_own_copys_checksum_and_leaves_the_stored_one(store, tmp_path):
    zero, one = _rank_dir(tmp_path, 0), _rank_dir(tmp_path, 1)
    store.upload_dir(zero, "c")
    entries = store.upload_dir(one, "c", replace=False)
    mine = (one / "model.pt").read_bytes()
    assert [(e.path, e.size, e.checksum) for e in entries] == [
        ("model.pt", len(mine), ("xxh3_128", xxhash.xxh3_128(mine).hexdigest()))]
    assert store.read_bytes("c/model.pt") == (zero / "model.pt").read_bytes()


def test_rank_zero_replaces_atomically_and_a_move_links_its_file_into_place(store, tmp_path):
    zero, one = _rank_dir(tmp_path, 0), _rank_dir(tmp_path, 1)
    store.upload_dir(one, "c", replace=False)
    stored = store.local_path("c/model.pt")
    reader = open(stored, "rb")  # a reader of the old copy keeps reading it whole: a rename, not a rewrite
    store.upload_dir(zero, "c", move=True)
    assert reader.read() == (one / "model.pt").read_bytes()
    reader.close()
    assert stored.stat().st_ino == (zero / "model.pt").stat().st_ino
    assert store.upload_dir(zero, "c", move=True)[0].size == stored.stat().st_size  # a retry finds it again


def test_racing_ranks_leave_rank_zeros_copy_every_time(store, tmp_path):
    dirs = {rank: _rank_dir(tmp_path, rank) for rank in range(4)}
    for trial in range(25):
        start = threading.Barrier(len(dirs))

        def upload(rank, dest=f"c{trial}"):
            start.wait()  # noqa: B023 - called before the loop goes on
            store.upload_dir(dirs[rank], dest, replace=rank == 0)

        threads = [threading.Thread(target=upload, args=(rank,)) for rank in dirs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.read_bytes(f"c{trial}/model.pt") == (dirs[0] / "model.pt").read_bytes(), trial
        assert _leftovers(store, f"c{trial}") == []


def test_without_hard_links_a_file_is_still_created_only_if_absent(store, tmp_path, monkeypatch):
    zero, one = _rank_dir(tmp_path, 0), _rank_dir(tmp_path, 1, {"only1.pt": b"mine"})

    def no_links(src, dst, **kw):
        raise PermissionError(1, "this file system has no hard links")

    monkeypatch.setattr(os, "link", no_links)
    store.upload_dir(zero, "c", move=True)
    store.upload_dir(one, "c", move=True, replace=False)
    assert store.read_bytes("c/model.pt") == (zero / "model.pt").read_bytes()
    assert store.read_bytes("c/only1.pt") == b"mine"
    assert _leftovers(store, "c") == []
