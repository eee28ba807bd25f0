"""Restores check every file against the manifest, every time, whatever wrote the manifest."""

import hashlib
import os

import pytest

from outlast.storage.local import LocalStorage
from outlast.storage.records import Manifest
from outlast.storage.restore import CorruptCheckpointError, materialize, verify
from outlast.storage.run_store import RunStore
from outlast.protocol.messages import FileEntry

NAME = "checkpoint_001_000003"


@pytest.fixture
def storage(tmp_path):
    return LocalStorage(tmp_path / "storage")


def _commit(storage, tmp_path, files: dict[str, bytes]) -> Manifest:
    src = tmp_path / "src"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    entries = storage.upload_dir(src, f"run/{NAME}")
    manifest = Manifest(checkpoint_dir=NAME, seq=1, attempt=1, report_index=3, committed_at=1.0, ranks=[0],
                        files=entries)
    RunStore(storage, "run").write_manifest(manifest)
    return manifest


def test_a_whole_checkpoint_restores_where_it_lies_on_a_file_system(storage, tmp_path):
    _commit(storage, tmp_path, {"model.pt": b"m" * 1000, "opt/state.pt": os.urandom(5000), "empty": b""})
    path = materialize(storage, "run", NAME, tmp_path / "cache")
    assert path == storage.local_path(f"run/{NAME}")
    assert (path / "opt" / "state.pt").stat().st_size == 5000


def test_a_file_corrupted_after_a_first_restore_is_caught_at_the_second(storage, tmp_path):
    _commit(storage, tmp_path, {"model.pt": b"weights" * 100})
    path = materialize(storage, "run", NAME, tmp_path / "cache")
    data = bytearray((path / "model.pt").read_bytes())
    data[10] ^= 0xFF  # same size, other bytes
    (path / "model.pt").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"file model\.pt does not match its checksum \(xxh3_128\)"):
        materialize(storage, "run", NAME, tmp_path / "cache")


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.unlink(), r"file b\.bin is missing"),
    (lambda p: p.write_bytes(b"short"), r"file b\.bin has 5 bytes, the manifest says 3000"),
])
def test_a_missing_or_truncated_file_is_named_with_what_is_wrong(storage, tmp_path, damage, reason):
    _commit(storage, tmp_path, {"a.bin": b"a" * 10, "b.bin": b"b" * 3000})
    damage(storage.local_path(f"run/{NAME}/b.bin"))
    with pytest.raises(CorruptCheckpointError, match=reason):
        materialize(storage, "run", NAME, tmp_path / "cache")


def test_a_checkpoint_whose_manifest_is_gone_cannot_be_restored(storage, tmp_path):
    _commit(storage, tmp_path, {"a": b"1"})
    storage.delete(f"run/{NAME}/.outlast-manifest.json")
    with pytest.raises(CorruptCheckpointError, match="its manifest is gone"):
        materialize(storage, "run", NAME, tmp_path / "cache")


def test_a_version_1_manifest_with_sha256_checksums_still_restores_and_still_catches_corruption(storage, tmp_path):
    # What an older outlast committed: sha256 of every file, manifest version 1.
    d = storage.local_path(f"run/{NAME}")
    d.mkdir(parents=True)
    (d / "model.pt").write_bytes(b"old weights")
    RunStore(storage, "run").write_manifest(Manifest(
        version=1, checkpoint_dir=NAME, seq=1, attempt=1, report_index=3, committed_at=1.0, ranks=[0],
        files=[FileEntry("model.pt", 11, hashlib.sha256(b"old weights").hexdigest())]))
    assert materialize(storage, "run", NAME, tmp_path / "cache") == d
    (d / "model.pt").write_bytes(b"new weights")
    with pytest.raises(CorruptCheckpointError, match=r"does not match its checksum \(sha256\)"):
        materialize(storage, "run", NAME, tmp_path / "cache")


def test_verify_names_the_first_bad_file_in_manifest_order_among_many(storage, tmp_path):
    manifest = _commit(storage, tmp_path, {f"shard-{i:03d}": os.urandom(100) for i in range(200)})
    root = storage.local_path(f"run/{NAME}")
    for i in (150, 40):
        (root / f"shard-{i:03d}").write_bytes(os.urandom(100))
    with pytest.raises(CorruptCheckpointError, match="shard-040"):
        verify(root, manifest)
