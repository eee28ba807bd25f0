import os
from pathlib import Path

import pytest
import xxhash

from outlast.storage.base import StorageError
from outlast.storage.checksum import hash_file
from outlast.storage.local import LocalStorage
from tests.fakes.files import rewritten


@pytest.fixture
def store(tmp_path):
    return LocalStorage(tmp_path / "root")


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    (d / "sub" / "deeper").mkdir(parents=True)
    (d / "model.pt").write_bytes(b"weights" * 1000)
    (d / "sub" / "opt.pt").write_bytes(b"")
    (d / "sub" / "deeper" / "x.bin").write_bytes(os.urandom(3 << 20))  # spans several read chunks
    return d


@pytest.mark.parametrize("move", [False, True])
def test_upload_dir_copies_nested_files_and_reports_sizes_and_xxh3_that_match_the_library(store, src, move):
    originals = {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    entries = store.upload_dir(src, "run/ckpt", move=move)
    assert sorted(e.path for e in entries) == ["model.pt", "sub/deeper/x.bin", "sub/opt.pt"]
    for e in entries:
        original = originals[e.path]
        assert e.size == len(original)
        assert e.checksum == ("xxh3_128", xxhash.xxh3_128(original).hexdigest())
        assert e.sha256 is None
        assert store.read_bytes(f"run/ckpt/{e.path}") == original


def test_upload_dir_recreates_empty_subdirectories(store, src):
    (src / "empty").mkdir()
    store.upload_dir(src, "c")
    assert store.list_dirs("c") == ["empty", "sub"]


def test_upload_from_a_missing_directory_raises_storage_error_naming_it(store, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(StorageError, match=str(missing)):
        store.upload_dir(missing, "c")


def test_upload_from_a_file_instead_of_a_directory_raises_storage_error(store, src):
    with pytest.raises(StorageError, match="not a directory"):
        store.upload_dir(src / "model.pt", "c")


def test_write_atomic_creates_parents_and_leaves_no_temp_files(store):
    store.write_atomic("a/b/doc.json", b"one")
    assert store.read_bytes("a/b/doc.json") == b"one"
    assert os.listdir(store.local_path("a/b")) == ["doc.json"]


def test_write_atomic_replaces_existing_content(store):
    store.write_atomic("doc", b"old and longer")
    store.write_atomic("doc", b"new")
    assert store.read_bytes("doc") == b"new"
    assert os.listdir(store.root) == ["doc"]


def test_write_atomic_moves_a_complete_temp_file_into_place_in_the_same_directory(store, monkeypatch):
    seen = []
    real_replace = os.replace

    def spy(tmp, target):
        seen.append((os.path.dirname(tmp), open(tmp, "rb").read()))
        real_replace(tmp, target)

    monkeypatch.setattr(os, "replace", spy)
    store.write_atomic("d/doc", b"payload")
    assert seen == [(str(store.local_path("d")), b"payload")]


def test_a_failed_write_atomic_keeps_the_old_bytes_and_removes_its_temp_file(store, monkeypatch):
    store.write_atomic("doc", b"old")

    def broken(*_):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        store.write_atomic("doc", b"new")
    assert store.read_bytes("doc") == b"old"
    assert os.listdir(store.root) == ["doc"]


def test_read_bytes_of_a_missing_path_raises_file_not_found(store):
    with pytest.raises(FileNotFoundError):
        store.read_bytes("missing")


def test_list_dirs_names_only_directories_sorted_and_is_empty_for_a_missing_path(store):
    store.write_atomic("run/b/file", b"")
    store.write_atomic("run/a/file", b"")
    store.write_atomic("run/not_a_dir", b"")
    assert store.list_dirs("run") == ["a", "b"]
    assert store.list_dirs("missing") == []
    assert store.list_dirs("") == ["run"]


def test_delete_removes_a_tree_a_file_and_ignores_a_missing_path(store):
    store.write_atomic("t/x/y", b"1")
    store.write_atomic("f", b"2")
    store.delete("t")
    store.delete("f")
    store.delete("never-there")
    assert not store.exists("t") and not store.exists("f")


def test_delete_of_a_symlinked_directory_removes_the_link_not_the_target(store, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_bytes(b"k")
    store.root.mkdir(parents=True)
    (store.root / "link").symlink_to(target)
    store.delete("link")
    assert not store.exists("link")
    assert (target / "keep").read_bytes() == b"k"


def test_uri_and_local_path_point_under_the_root(store):
    assert store.local_path("a/b") == store.root / "a" / "b"
    assert store.uri("a") == str(store.root / "a")


def test_a_move_upload_on_the_same_file_system_copies_no_bytes_and_keeps_the_source_for_a_retry(store, src):
    first = store.upload_dir(src, "c", move=True)
    placed = store.local_path("c/sub/deeper/x.bin")
    assert placed.stat().st_ino == (src / "sub" / "deeper" / "x.bin").stat().st_ino
    assert store.upload_dir(src, "c", move=True) == first  # a retry finds every file again


def test_a_plain_upload_is_a_copy_that_later_writes_to_the_source_do_not_reach(store, src):
    store.upload_dir(src, "c")
    (src / "model.pt").write_bytes(b"changed")
    assert store.read_bytes("c/model.pt") == b"weights" * 1000


def test_a_file_rewritten_during_its_upload_is_listed_with_the_digest_of_the_bytes_stored(store, src):
    changing = src / "sub" / "deeper" / "x.bin"
    with rewritten(changing, 1 << 19):
        for attempt in range(3):
            entries = {e.path: e for e in store.upload_dir(src, f"c{attempt}")}
            stored = store.local_path(f"c{attempt}/sub/deeper/x.bin")
            assert (entries["sub/deeper/x.bin"].size, entries["sub/deeper/x.bin"].xxh3_128) == hash_file(stored)


def test_download_dir_copies_a_tree_and_a_missing_one_raises_file_not_found(store, src, tmp_path):
    store.upload_dir(src, "c")
    store.download_dir("c", tmp_path / "out")
    deeper = Path("sub") / "deeper" / "x.bin"
    assert (tmp_path / "out" / deeper).read_bytes() == (src / deeper).read_bytes()
    with pytest.raises(FileNotFoundError):
        store.download_dir("missing", tmp_path / "out2")
