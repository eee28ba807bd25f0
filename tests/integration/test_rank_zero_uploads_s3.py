"""Ranks sharing a checkpoint directory on S3 (a moto server on loopback): rank 0's PUT replaces
an object, the others' PUTs are conditional (If-None-Match: *), so the bucket holds rank 0's
copy whatever the order of the uploads."""

from __future__ import annotations

import threading

import boto3
import pytest
import xxhash

from outlast.storage import open_storage


def _rank_dir(tmp_path, rank):
    d = tmp_path / f"rank{rank}"
    d.mkdir()
    (d / "model.pt").write_bytes(f"rank {rank} weights".encode() * 1000)
    (d / f"rank{rank}.pt").write_bytes(b"own")
    return d


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_the_stored_object_is_rank_zeros_whatever_the_order(s3, tmp_path, order):  # noqa: F811
    storage = open_storage("s3://runs/exp")
    dirs = {rank: _rank_dir(tmp_path, rank) for rank in (0, 1)}
    entries = {rank: storage.upload_dir(dirs[rank], "run/c", replace=rank == 0) for rank in order}
    assert storage.read_bytes("run/c/model.pt") == (dirs[0] / "model.pt").read_bytes()
    assert storage.read_bytes("run/c/rank1.pt") == storage.read_bytes("run/c/rank0.pt") == b"own"
    # Each rank's entries describe its own copy, stored or not: the controller compares them.
    for rank in (0, 1):
        mine = (dirs[rank] / "model.pt").read_bytes()
        (entry,) = [e for e in entries[rank] if e.path == "model.pt"]
        assert entry.checksum == ("xxh3_128", xxhash.xxh3_128(mine).hexdigest())


def test_a_conditional_put_is_what_refuses_the_later_rank(s3, tmp_path):  # noqa: F811
    storage = open_storage("s3://runs/exp")
    zero, one = _rank_dir(tmp_path, 0), _rank_dir(tmp_path, 1)
    storage.upload_dir(zero, "run/c")
    etag = boto3.client("s3").head_object(Bucket="runs", Key="exp/run/c/model.pt")["ETag"]
    storage.upload_dir(one, "run/c", replace=False)
    assert boto3.client("s3").head_object(Bucket="runs", Key="exp/run/c/model.pt")["ETag"] == etag
    storage.upload_dir(zero, "run/c")  # rank 0's retry replaces its own copy: no error
    assert storage.read_bytes("run/c/model.pt") == (zero / "model.pt").read_bytes()


def test_racing_ranks_leave_rank_zeros_object_every_time(s3, tmp_path):  # noqa: F811
    storage = open_storage("s3://runs/exp")
    dirs = {rank: _rank_dir(tmp_path, rank) for rank in range(3)}
    for trial in range(5):
        start = threading.Barrier(len(dirs))
        errors = []

        def upload(rank, dest=f"run/c{trial}"):
            start.wait()  # noqa: B023 - called before the loop goes on
            try:
                storage.upload_dir(dirs[rank], dest, replace=rank == 0)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)  # noqa: B023 - called before the loop goes on

        threads = [threading.Thread(target=upload, args=(rank,)) for rank in dirs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert storage.read_bytes(f"run/c{trial}/model.pt") == (dirs[0] / "model.pt").read_bytes(), trial
