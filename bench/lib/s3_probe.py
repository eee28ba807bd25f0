"""One timed transfer of a checkpoint directory to or from S3, in a fresh process.

    python -m bench.lib.s3_probe --method M --op upload|restore --local DIR --url s3://BUCKET/PREFIX

upload: the files of --local to the objects under --url; restore: the objects under --url into the new
directory --local, then every byte of it read once (what a rank does with a restored checkpoint).
Imports and clients are made before the clock starts, as a training process has them, and then the probe
waits --settle-s (3 s) before it: every method starts from the same state of the machine's memory, however
long its imports took. On a VM that hands freed memory back to its host (Linux's free page reporting,
2 s after the pages are freed), the previous transfer's files, deleted just before, are memory a quick
starter still holds and a slow one must fault in again from the host as its page cache fills (the time
shows inside the kernel's copy of each written range into the page cache). docs/benchmarks.md has the
figures with and without the wait.
Methods:
  outlast   outlast's storage layer: RemoteStorage.upload_dir (xxh3 taken beside the upload); restore =
            restore.materialize (download_dir, then every file checked against the manifest), which
            is what a rank's get_checkpoint().as_directory() runs for a checkpoint not on its node
  outlast_fsspec
            the same with the S3 bytes through fsspec (s3fs), as outlast moved them before object_store
  ray       Ray Train V2's copy: pyarrow's S3 file system through _pyarrow_fs_copy_files
  boto3     a plain boto3 client's transfer manager, 8 threads (s3transfer, 8 MiB parts)
  crt       boto3's transfer manager on the AWS CRT (awscrt's native S3 client)
  obstore   Rust's object_store: files and 16 MiB ranges on 16 threads; uploads multipart (16 MiB parts, 8
            at a time per file)
  s3fs      s3fs alone, more concurrency and larger parts (64 MiB parts, 16 at a time; files in parallel)
Prints {"s": seconds, "bytes": n}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MiB = 1 << 20
THREADS = 16


def files_under(root):
    return sorted(p.relative_to(root).as_posix() for p in Path(root).rglob("*") if p.is_file())


def read_all(root):
    """Every byte under `root`, read once: the rank's use of what it restored."""
    n = 0
    buf = bytearray(8 * MiB)
    for rel in files_under(root):
        with open(Path(root, rel), "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return n


def bucket_key(url):
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


def endpoint():
    return os.environ["AWS_ENDPOINT_URL"]


class Outlast:
    def __init__(self, url):
        from outlast.storage import open_storage
        from outlast.storage.restore import materialize

        root, _, self.name = url.rstrip("/").rpartition("/")
        top, _, self.run = root.rpartition("/")
        self.storage, self.materialize = open_storage(top), materialize
        self.storage.exists(self.run)  # the client made and connected, as the others' are before the clock

    def upload(self, local):
        self.storage.upload_dir(Path(local), f"{self.run}/{self.name}")

    def restore(self, local):
        # The node's checkpoint cache is `local`; the checkpoint lands in a directory inside it.
        return self.materialize(self.storage, self.run, self.name, Path(local))


class OutlastFsspec(Outlast):
    """outlast with its S3 bytes through fsspec (s3fs), as before they moved onto object_store: the same
    storage layer with RemoteStorage's object_store client switched off."""

    def __init__(self, url):
        super().__init__(url)
        self.storage._bulk = lambda: None


class Ray:
    def __init__(self, url):
        import pyarrow.fs
        from ray.train.v2._internal.execution.storage import _pyarrow_fs_copy_files

        self.fs, self.path = pyarrow.fs.FileSystem.from_uri(url)
        self.local_fs, self.copy = pyarrow.fs.LocalFileSystem(), _pyarrow_fs_copy_files

    def upload(self, local):
        self.fs.create_dir(self.path)
        self.copy(str(local), self.path, source_filesystem=self.local_fs, destination_filesystem=self.fs)

    def restore(self, local):
        os.makedirs(local)
        self.copy(self.path, str(local), source_filesystem=self.fs, destination_filesystem=self.local_fs)


class Boto3:
    def __init__(self, url, crt=False):
        import boto3
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        self.client = boto3.client("s3")
        self.bucket, self.prefix = bucket_key(url)
        self.manager = crt_manager() if crt else create_transfer_manager(self.client, TransferConfig(max_concurrency=8))

    def keys(self):
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + "/")
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def upload(self, local):
        jobs = [self.manager.upload(str(Path(local, rel)), self.bucket, f"{self.prefix}/{rel}")
                for rel in files_under(local)]
        for job in jobs:
            job.result()

    def restore(self, local):
        jobs = []
        for key in self.keys():
            target = Path(local, key[len(self.prefix) + 1:])
            target.parent.mkdir(parents=True, exist_ok=True)
            jobs.append(self.manager.download(self.bucket, key, str(target)))
        for job in jobs:
            job.result()


def crt_manager():
    """s3transfer's manager on the CRT's S3 client, as boto3 makes it (boto3/crt.py) but for a plain-HTTP
    endpoint: boto3 makes its CRT client with TLS always on."""
    import botocore.session
    from s3transfer.crt import (BotocoreCRTCredentialsWrapper, BotocoreCRTRequestSerializer, CRTTransferManager,
                                create_s3_crt_client)

    session = botocore.session.Session()
    region = os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
    credentials = BotocoreCRTCredentialsWrapper(session.get_credentials()).to_crt_credentials_provider()
    client = create_s3_crt_client(region=region, crt_credentials_provider=credentials,
                                  use_ssl=endpoint().startswith("https://"))
    return CRTTransferManager(client, BotocoreCRTRequestSerializer(session, {"region_name": region,
                                                                            "endpoint_url": endpoint()}))


class Obstore:
    PART = 16 * MiB

    def __init__(self, url):
        import obstore
        from obstore.store import S3Store

        bucket, self.prefix = bucket_key(url)
        self.obs = obstore
        self.store = S3Store(bucket, endpoint=endpoint(), region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
                             access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                             secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                             client_options={"allow_http": True})
        self.pool = ThreadPoolExecutor(THREADS)

    def upload(self, local):
        jobs = [self.pool.submit(self.obs.put, self.store, f"{self.prefix}/{rel}", Path(local, rel),
                                 chunk_size=self.PART, max_concurrency=8) for rel in files_under(local)]
        for job in jobs:
            job.result()

    def _range(self, key, target, start, end):
        data = self.obs.get_range(self.store, key, start=start, end=end)
        fd = os.open(target, os.O_WRONLY)
        try:
            os.pwrite(fd, memoryview(data), start)
        finally:
            os.close(fd)

    def restore(self, local):
        jobs = []
        for page in self.obs.list(self.store, self.prefix + "/"):
            for meta in page:
                target = Path(local, meta["path"][len(self.prefix) + 1:])
                target.parent.mkdir(parents=True, exist_ok=True)
                size = meta["size"]
                with open(target, "wb") as f:
                    f.truncate(size)
                for start in range(0, size, self.PART):
                    jobs.append(self.pool.submit(self._range, meta["path"], target, start,
                                                 min(start + self.PART, size)))
        for job in jobs:
            job.result()


class S3fs:
    def __init__(self, url):
        import s3fs

        self.fs = s3fs.S3FileSystem(max_concurrency=THREADS, skip_instance_cache=True)
        self.path = url.removeprefix("s3://").rstrip("/")

    def upload(self, local):
        self.fs.put(str(local).rstrip("/") + "/", self.path + "/", recursive=True, chunksize=64 * MiB,
                    batch_size=THREADS)

    def restore(self, local):
        self.fs.get(self.path + "/", str(local).rstrip("/") + "/", recursive=True, batch_size=THREADS)


METHODS = {"outlast": Outlast, "outlast_fsspec": OutlastFsspec, "ray": Ray, "boto3": Boto3, "crt": lambda url: Boto3(url, crt=True),
           "obstore": Obstore, "s3fs": S3fs}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", required=True, choices=sorted(METHODS))
    p.add_argument("--op", required=True, choices=["upload", "restore"])
    p.add_argument("--local", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--settle-s", type=float, default=3.0, help="wait this long after set-up, before the clock")
    args = p.parse_args()
    side = METHODS[args.method](args.url)
    time.sleep(args.settle_s)
    t0 = time.perf_counter()
    if args.op == "upload":
        side.upload(args.local)
        n = sum(Path(args.local, rel).stat().st_size for rel in files_under(args.local))
    else:
        n = read_all(side.restore(args.local) or args.local)
    print(json.dumps({"s": time.perf_counter() - t0, "bytes": n}))


if __name__ == "__main__":
    main()
