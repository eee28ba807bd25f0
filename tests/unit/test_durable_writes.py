"""A power loss must not leave a manifest naming files that are not there: every uploaded file
and directory is fsynced before `upload_dir` returns, and `write_atomic`'s rename is fsynced."""

from __future__ import annotations

import os

import pytest

from outlast.storage.local import LocalStorage, dirs_to_fsync


@pytest.fixture
def synced(monkeypatch):
    """The paths fsynced, in order, with the renames and links between them (the real calls still happen)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        real_replace(src, dst)
        events.append(("rename", str(dst)))

    def link(src, dst):
        real_link(src, dst)
        events.append(("link", str(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "link", link)
    return events


def test_every_uploaded_file_and_directory_is_fsynced_before_upload_returns(tmp_path, synced):
    src = tmp_path / "ckpt"
    (src / "shards" / "deep").mkdir(parents=True)
    (src / "model.pt").write_bytes(b"m" * 1000)
    (src / "shards" / "deep" / "0.pt").write_bytes(b"s" * 10)
    storage = LocalStorage(tmp_path / "store")
    storage.upload_dir(src, "run/checkpoint_001_000001")
    done = tmp_path / "store" / "run" / "checkpoint_001_000001"
    fsynced = {path for kind, path in synced if kind == "fsync"}
    for path in (done / "model.pt", done / "shards" / "deep" / "0.pt", done / "shards" / "deep", done / "shards",
                 done, done.parent):
        assert str(path) in fsynced, path


@pytest.mark.parametrize("replace", [True, False], ids=["renamed", "linked"])
def test_each_file_is_fsynced_once_placed_and_its_directory_after_the_last_file_is_placed_in_it(tmp_path, synced,
                                                                                                  replace):
    src = tmp_path / "ckpt"
    (src / "shards").mkdir(parents=True)
    for name in ("a.pt", "b.pt", "shards/0.pt", "shards/1.pt"):
        (src / name).write_bytes(name.encode() * 1000)
    LocalStorage(tmp_path / "store").upload_dir(src, "run/ckpt", replace=replace)
    done = tmp_path / "store" / "run" / "ckpt"
    placed = {path: i for i, (kind, path) in enumerate(synced) if kind in ("rename", "link")}
    fsynced = {path: i for i, (kind, path) in enumerate(synced) if kind == "fsync"}
    for name in ("a.pt", "b.pt", "shards/0.pt", "shards/1.pt"):
        assert placed[str(done / name)] < fsynced[str(done / name)], name
    for d, names in ((done, ("a.pt", "b.pt")), (done / "shards", ("shards/0.pt", "shards/1.pt"))):
        assert fsynced[str(d)] > max(placed[str(done / n)] for n in names), d


def test_the_directories_above_the_files_are_fsynced_apart_from_those_the_files_go_into(tmp_path):
    top = tmp_path / "run" / "ckpt"
    above, holding = dirs_to_fsync(top, {top / "a" / "b" / "c", top / "a" / "d"})
    assert holding == [top / "a" / "b" / "c", top / "a" / "d"]
    assert above == [top / "a" / "b", top / "a", top, top.parent]
    assert dirs_to_fsync(top, {top}) == ([top.parent], [top])
    assert dirs_to_fsync(top, set()) == ([top, top.parent], [])


def test_write_atomic_fsyncs_the_directory_after_the_rename(tmp_path, synced):
    LocalStorage(tmp_path).write_atomic("run/.outlast-manifest.json", b"{}")
    target = tmp_path / "run" / ".outlast-manifest.json"
    rename = synced.index(("rename", str(target)))
    assert ("fsync", str(target.parent)) in synced[rename:]
