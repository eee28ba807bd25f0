"""An object whose key climbs out of its checkpoint's directory, written by anyone who can write the bucket,
is refused by the machine that downloads the checkpoint: nothing lands outside the directory asked for."""

from __future__ import annotations

import os

import boto3
import pytest

from outlast.storage.base import StorageError
from outlast.train import Checkpoint


def test_a_checkpoint_download_refuses_an_object_whose_key_leaves_the_checkpoint(s3, tmp_path):
    bucket = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    bucket.put_object(Bucket="runs", Key="exp/ckpt/model.pt", Body=b"model")
    climb = "../" * 12 + str(tmp_path.relative_to("/")) + "/escaped.txt"
    bucket.put_object(Bucket="runs", Key=f"exp/ckpt/{climb}", Body=b"planted")
    dest = tmp_path / "a/b/c/dest"
    with pytest.raises(StorageError, match=r"not a file inside it \(its component '\.\.'.*remove that object"):
        Checkpoint("s3://runs/exp/ckpt").to_directory(str(dest))
    assert not (tmp_path / "escaped.txt").exists()
    assert not dest.exists() or not any(p.is_file() for p in dest.rglob("*"))
