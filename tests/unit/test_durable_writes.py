"""A power loss must not leave a manifest naming files that are not there: every uploaded file
and directory is fsynced before `upload_dir` returns, and `write_atomic`'s rename is fsynced."""

from __future__ import annotations

import os

import pytest

from outlast.storage.local import LocalStorage


@pytest.fixture
def synced(monkeypatch):
    """The paths fsynced, in order, with the renames between them (the real calls still happen)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        real_replace(src, dst)
        events.append(("rename", str(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
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


def test_write_atomic_fsyncs_the_directory_after_the_rename(tmp_path, synced):
    LocalStorage(tmp_path).write_atomic("run/.outlast-manifest.json", b"{}")
    target = tmp_path / "run" / ".outlast-manifest.json"
    rename = synced.index(("rename", str(target)))
    assert ("fsync", str(target.parent)) in synced[rename:]
