"""A checkpoint's bytes to and from S3 through Rust's object_store (the obstore package).

fsspec (s3fs) stays the interface: the URL users give, the listings, the documents and their bounded
reads, the conditional writes (a create-only upload too: object_store sends If-None-Match only on a
single PUT, which would hold the whole file in memory). A checkpoint's files are most of the bytes a
run moves, and there s3fs is the bottleneck: each part goes through aiobotocore and Python's event
loop chunk by chunk, where object_store reads the local file, sends and receives on Rust's threads
with the GIL released (bench/s3_paths.py measures both against Ray's pyarrow and the clients alone;
docs/benchmarks.md has the figures).

The store reaches the bucket as s3fs's own client does: the endpoint and region that client resolved
(`AWS_ENDPOINT_URL`, config files), and the credentials it signs with, or none where s3fs is anonymous:
the file system's own key and secret, else the set its session's chain (environment, config files,
profiles, instance roles) found when the client was made. A fixed set is handed to object_store as it
is; a refreshable one (a role's) through a provider it asks again. The chain is not walked a second time. object_store retries a failed request itself, with
backoff; what it still cannot fetch is the caller's error, and every restored file is checked against
its manifest afterwards (with the digest taken as its ranges landed, `range_digest`).
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import obstore
    from fsspec import AbstractFileSystem
    from obstore.store import ClientConfig, S3Config, S3Credential, S3Store

PART = 16 << 20  # one ranged GET; a file is fetched as its parts, in parallel
UPLOAD_PART = 16 << 20  # one part of a multipart upload (S3 takes none under 5 MiB but the last)
UPLOAD_PARTS = 8  # parts of one file in flight; the files of a checkpoint go up beside each other
# Ranges in flight: a thread waits on the network inside Rust, with the GIL released, so more of them
# than the I/O pool has (two per core) keep the connection busy; each holds one PART in memory.
CONCURRENCY = 16
_CREDENTIALS_TTL = timedelta(minutes=10)  # how long object_store keeps a set before asking botocore again
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    """The threads that fetch ranges. Made on first use, never at import: a process that forks workers
    must have no threads."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=CONCURRENCY, thread_name_prefix="outlast-s3-range")
        return _pool


class BulkClient:
    """The objects of one bucket: ranges of them written into their places in local files, local files
    uploaded to them."""

    def __init__(self, store: S3Store) -> None:
        self.store = store

    @classmethod
    def of(cls, fs: AbstractFileSystem, bucket: str) -> BulkClient:
        """A client of `bucket` that reaches it as `fs` (an s3fs file system that has made its client) does."""
        from obstore.store import S3Store

        client = fs.s3  # s3fs's aiobotocore client, made now if no call has made it yet
        endpoint: str = client.meta.endpoint_url
        config: S3Config = {"region": client.meta.region_name or "us-east-1"}
        if not endpoint.split("://", 1)[-1].split("/", 1)[0].endswith(".amazonaws.com"):
            config["endpoint"] = endpoint  # an S3-compatible server; AWS's own is found from the region
        options: ClientConfig = {"allow_http": endpoint.startswith("http://"), "timeout": "300s"}
        if fs.anon:
            return cls(S3Store(bucket, config={**config, "skip_signature": True}, client_options=options))
        credentials = _Credentials(fs)
        if credentials.fixed is not None:
            return cls(S3Store(bucket, config={**config, **credentials.fixed}, client_options=options))
        return cls(S3Store(bucket, config=config, credential_provider=credentials, client_options=options))

    def read_into(self, key: str, target: Path, start: int, end: int) -> obstore.Bytes:
        """Bytes [start, end) of object `key` into the same place of the file `target`, which exists; returns
        them, as object_store's buffer (the caller hashes them from it). FileNotFoundError when the object is gone."""
        import obstore
        from obstore.exceptions import BaseError, NotFoundError

        try:
            data = obstore.get_range(self.store, key, start=start, end=end)
        except NotFoundError as e:
            raise FileNotFoundError(f"{key}: {brief(e)}") from None
        except BaseError as e:
            raise OSError(brief(e)) from None
        if len(data) != end - start:
            raise OSError(f"{key}: asked for bytes {start}-{end}, the server sent {len(data)}")
        fd = os.open(target, os.O_WRONLY)
        try:
            os.pwrite(fd, memoryview(data), start)
        finally:
            os.close(fd)
        return data


    def put_file(self, src: str, key: str) -> None:
        """The local file `src` to object `key`, replacing what is there: one PUT, or a multipart upload
        once it is over an UPLOAD_PART, which the server shows whole or not at all."""
        import obstore
        from obstore.exceptions import BaseError

        try:
            obstore.put(self.store, key, Path(src), chunk_size=UPLOAD_PART, max_concurrency=UPLOAD_PARTS)
        except BaseError as e:
            raise OSError(brief(e)) from None


def brief(e: Exception) -> str:
    """object_store's error in a line: its own first line, and the cause at the bottom of the nested
    "Debug source" that follows it (e.g. "Connection refused"), where the first line says only that a
    request failed. The whole of it is some forty lines of Rust structs."""
    text = str(e)
    first = text.split("\n", 1)[0].strip()
    causes = re.findall(r'message: "([^"]*)"', text)
    return f"{first} ({causes[-1]})" if causes and causes[-1] not in first else first


class _Credentials:
    """object_store's credentials from where s3fs's client takes them: the file system's own key and secret
    when it was given them, else the set its session resolved for the client (aiobotocore's chain, which
    honours the session's profile). `fixed`: the keys to hand object_store once, where they never change;
    None where they are refreshable (a role's), which object_store then asks this provider for again."""

    def __init__(self, fs: AbstractFileSystem) -> None:
        self.fs = fs
        self.chain: Any = None
        self.fixed: S3Config | None = None
        if fs.key and fs.secret:
            self.fixed = _keys(fs.key, fs.secret, fs.token)
            return
        from botocore.credentials import RefreshableCredentials
        from fsspec.asyn import sync

        fs.s3  # noqa: B018 - the client made, and with it the session and the credentials it signs with
        self.chain = sync(fs.loop, fs.session.get_credentials)  # the session's own, resolved once and kept
        if self.chain is None:
            raise OSError("no AWS credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                          "or a profile in ~/.aws/credentials)")
        if not isinstance(self.chain, RefreshableCredentials):
            frozen = sync(fs.loop, self.chain.get_frozen_credentials)
            self.fixed = _keys(frozen.access_key, frozen.secret_key, frozen.token)

    def __call__(self) -> S3Credential:
        from fsspec.asyn import sync

        frozen = sync(self.fs.loop, self.chain.get_frozen_credentials)  # refreshed by the chain when near expiry
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
                "expires_at": datetime.now(timezone.utc) + _CREDENTIALS_TTL}


def _keys(key: str, secret: str, token: str | None) -> S3Config:
    keys: S3Config = {"access_key_id": key, "secret_access_key": secret}
    if token:
        keys["session_token"] = token
    return keys
