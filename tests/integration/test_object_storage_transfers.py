"""Checkpoint bytes to and from S3 (a moto server on loopback): many files at once, large
files in parallel parts and ranges, and every restore checked against the manifest."""

from __future__ import annotations

import os
from pathlib import Path

import boto3
import pytest
import xxhash

from outlast.storage import open_storage, remote, s3_bulk
from outlast.storage.records import Manifest
from outlast.storage.restore import CorruptCheckpointError, materialize
from outlast.storage.run_store import RunStore

NAME = "checkpoint_001_000000"


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "src"
    (src / "shards").mkdir(parents=True)
    files = {"model.pt": os.urandom((3 << 20) + 5), "empty": b""}
    files.update({f"shards/{i:02d}.bin": os.urandom(1000 + i) for i in range(40)})
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    return src, files


def _commit(storage, src) -> Manifest:
    entries = storage.upload_dir(src, f"run/{NAME}")
    manifest = Manifest(checkpoint_dir=NAME, seq=1, attempt=1, report_index=0, committed_at=1.0, ranks=[0],
                        files=entries)
    RunStore(storage, "run").write_manifest(manifest)
    return manifest


def test_many_files_and_a_large_one_round_trip_with_their_checksums(s3, tree, tmp_path, monkeypatch):  # noqa: F811
    # The 3 MB file comes back in four ranged gets, through object_store on S3 as through fsspec elsewhere.
    monkeypatch.setattr(s3_bulk, "PART", 1 << 20)
    monkeypatch.setattr(remote, "_RANGE", 1 << 20)
    ranges = []
    read_into = s3_bulk.BulkClient.read_into
    monkeypatch.setattr(s3_bulk.BulkClient, "read_into",
                        lambda self, key, *args: ranges.append((key, *args)) or read_into(self, key, *args))
    src, files = tree
    storage = open_storage("s3://runs/transfers")
    manifest = _commit(storage, src)
    assert {e.path: e.checksum for e in manifest.files} == {
        rel: ("xxh3_128", xxhash.xxh3_128(data).hexdigest()) for rel, data in files.items()}
    path = materialize(storage, "run", NAME, tmp_path / "cache")
    for rel, data in files.items():
        assert (path / rel).read_bytes() == data
    assert sorted(start for key, _, start, _ in ranges if key.endswith("/model.pt")) == [0, 1 << 20, 2 << 20, 3 << 20]


def test_a_restored_copy_that_rots_in_the_node_cache_is_fetched_again(s3, tree, tmp_path):  # noqa: F811
    src, files = tree
    storage = open_storage("s3://runs/rot")
    _commit(storage, src)
    path = materialize(storage, "run", NAME, tmp_path / "cache")
    (path / "shards" / "07.bin").write_bytes(b"rotted")
    again = materialize(storage, "run", NAME, tmp_path / "cache")
    assert (again / "shards" / "07.bin").read_bytes() == files["shards/07.bin"]


def test_an_object_changed_in_the_bucket_is_caught_at_the_next_restore(s3, tree, tmp_path):  # noqa: F811
    src, _ = tree
    storage = open_storage("s3://runs/changed")
    _commit(storage, src)
    boto3.client("s3").put_object(Bucket="runs", Key=f"changed/run/{NAME}/model.pt", Body=b"not the model")
    with pytest.raises(CorruptCheckpointError, match=r"file model\.pt has 13 bytes, the manifest says 3145733"):
        materialize(storage, "run", NAME, tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").glob("*/*checkpoint_*") if not p.name.endswith(".lock")]


def _through(storage, path):
    """The restore's bytes through object_store (`s3_bulk`), or through fsspec as on gs:// and the rest."""
    if path == "fsspec":
        storage._bulk = lambda: None
    return storage


def _hashed_by_the_check(monkeypatch):
    """The files the check against the manifest reads and hashes itself (restore.hash_file, spied on)."""
    from outlast.storage import restore

    read_again = []
    hash_file = restore.hash_file
    monkeypatch.setattr(restore, "hash_file", lambda path, *a: read_again.append(Path(path).name) or hash_file(path, *a))
    return read_again


def _committed_in_ranges(monkeypatch, tree, prefix: str, path: str):
    """The tree committed under `prefix` of the bucket, read back through `path` in ranges of 1 MiB (model.pt's
    3 MiB and 5 bytes in four)."""
    monkeypatch.setattr(s3_bulk, "PART", 1 << 20)
    monkeypatch.setattr(remote, "_RANGE", 1 << 20)
    src, _ = tree
    storage = _through(open_storage(f"s3://runs/{prefix}"), path)
    _commit(storage, src)
    return storage


@pytest.mark.parametrize("path", ["object_store", "fsspec"])
def test_a_file_of_many_ranges_is_checked_with_the_digest_taken_as_its_ranges_landed(s3, tree, tmp_path,  # noqa: F811
                                                                                       monkeypatch, path):
    files = tree[1]
    storage = _committed_in_ranges(monkeypatch, tree, f"streamed-{path}", path)
    read_again = _hashed_by_the_check(monkeypatch)
    restored = materialize(storage, "run", NAME, tmp_path / "cache")
    for rel, data in files.items():
        assert (restored / rel).read_bytes() == data
    assert "model.pt" not in read_again  # its four ranges were hashed as they landed: nothing read back


@pytest.mark.parametrize("path", ["object_store", "fsspec"])
def test_an_object_whose_one_range_differs_at_the_same_size_fails_its_checksum_and_is_not_kept(s3, tree, tmp_path,  # noqa: F811
                                                                                                 monkeypatch, path):
    files = tree[1]
    storage = _committed_in_ranges(monkeypatch, tree, f"tampered-{path}", path)
    tampered = bytearray(files["model.pt"])
    tampered[(2 << 20) + 17] ^= 0xFF  # one byte of the third range, the size unchanged
    boto3.client("s3").put_object(Bucket="runs", Key=f"tampered-{path}/run/{NAME}/model.pt", Body=bytes(tampered))
    read_again = _hashed_by_the_check(monkeypatch)
    with pytest.raises(CorruptCheckpointError, match=r"file model\.pt does not match its checksum \(xxh3_128\)"):
        materialize(storage, "run", NAME, tmp_path / "cache")
    assert "model.pt" not in read_again  # caught by the digest taken as the ranges landed
    run_cache, = (tmp_path / "cache").iterdir()
    assert sorted(p.name for p in run_cache.iterdir()) == [f"{NAME}.lock"]  # no copy, no partial, no marker


def test_an_upload_to_a_server_that_is_down_fails_in_one_line_naming_the_cause(s3, tree):  # noqa: F811
    """object_store's own error is some forty lines of nested Rust structs; what reaches a user is its first line
    and the cause at the bottom of it."""
    src, _ = tree
    storage = open_storage("s3://runs/down")
    storage.write_atomic("probe", b"x")  # the client is made while the server is up
    s3.stop()
    with pytest.raises(OSError) as failed:
        storage.upload_dir(src, f"run/{NAME}")
    text = str(failed.value)
    assert "\n" not in text and "Debug source" not in text
    assert "Connection refused" in text and f"run/{NAME}/" in text


def test_fixed_credentials_are_handed_to_object_store_without_a_second_walk_of_the_chain(s3, tree, tmp_path,  # noqa: F811
                                                                                         monkeypatch):
    """The keys in the environment, which s3fs's session resolved when its client was made, go to object_store
    as they are: no botocore session of its own, no provider for object_store to call back into Python."""
    import botocore.session

    monkeypatch.setattr(botocore.session, "get_session", lambda *a, **k: pytest.fail("the chain walked again"))
    src, files = tree
    storage = open_storage("s3://runs/fixed")
    manifest = _commit(storage, src)
    credentials = s3_bulk._Credentials(storage.fs)
    assert credentials.fixed == {"access_key_id": "testing", "secret_access_key": "testing"}
    path = materialize(storage, "run", NAME, tmp_path / "cache")
    assert [(path / e.path).read_bytes() for e in manifest.files] == [files[e.path] for e in manifest.files]


def test_a_file_system_given_its_own_keys_signs_with_them(s3):  # noqa: F811
    import s3fs

    fs = s3fs.S3FileSystem(key="given", secret="its-secret", token="a-token", skip_instance_cache=True)
    assert s3_bulk._Credentials(fs).fixed == {"access_key_id": "given", "secret_access_key": "its-secret",
                                              "session_token": "a-token"}


def test_refreshable_credentials_reach_object_store_through_a_provider_asked_again(s3, tree, tmp_path,  # noqa: F811
                                                                                    monkeypatch):
    """A role's credentials expire: object_store is handed a provider that asks the session's set, which botocore
    refreshes, each time it needs them."""
    from datetime import datetime, timedelta, timezone

    from aiobotocore.credentials import AioRefreshableCredentials

    fetched = []

    async def refresh():
        fetched.append(1)
        return {"access_key": "role-key", "secret_key": "role-secret", "token": f"role-token-{len(fetched)}",
                "expiry_time": (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()}

    src, files = tree
    storage = open_storage("s3://runs/role")
    manifest = _commit(storage, src)  # made with the environment's keys
    role = AioRefreshableCredentials.create_from_metadata(
        metadata={"access_key": "role-key", "secret_key": "role-secret", "token": "role-token-0",
                  "expiry_time": (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()},
        refresh_using=refresh, method="assume-role")

    async def session_credentials():
        return role

    monkeypatch.setattr(storage.fs.session, "get_credentials", session_credentials)
    credentials = s3_bulk._Credentials(storage.fs)
    assert credentials.fixed is None
    assert credentials()["token"] == "role-token-0" and credentials()["access_key_id"] == "role-key"
    storage._bulk_client = None  # made again, now through the provider
    path = materialize(storage, "run", NAME, tmp_path / "cache")
    assert [(path / e.path).read_bytes() for e in manifest.files] == [files[e.path] for e in manifest.files]


def test_an_anonymous_file_system_reads_without_signing(s3, tmp_path):  # noqa: F811
    import s3fs

    boto3.client("s3").put_object(Bucket="runs", Key="public/blob", Body=b"0123456789", ACL="public-read")
    fs = s3fs.S3FileSystem(anon=True, skip_instance_cache=True)
    target = tmp_path / "blob"
    target.write_bytes(b"\0" * 10)
    s3_bulk.BulkClient.of(fs, "runs").read_into("public/blob", target, 2, 6)
    assert target.read_bytes() == b"\0\0" + b"2345" + b"\0" * 4
