"""S3's compare-and-swap reads a document whole however its body arrives: a read returns what has come, up to
what is asked, and a lease read short would count as no lease."""

from __future__ import annotations

import msgspec
from fsspec.asyn import get_loop

from outlast.storage import records as r
from outlast.storage.conditional import S3Conditional
from outlast.storage.lease import Lease


class TrickleBody:
    """A response body that gives at most `step` bytes a read, as a socket does."""

    def __init__(self, data: bytes, step: int) -> None:
        self.data, self.step = data, step

    async def read(self, n: int = -1) -> bytes:
        take = min(self.step, len(self.data) if n < 0 else n)
        out, self.data = self.data[:take], self.data[take:]
        return out

    async def __aenter__(self) -> "TrickleBody":
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class FakeS3:
    def __init__(self, data: bytes, step: int) -> None:
        self.loop = get_loop()
        self.data, self.step = data, step

    def split_path(self, path: str) -> tuple[str, str, None]:
        bucket, _, key = path.partition("/")
        return bucket, key, None

    async def _call_s3(self, method: str, **kw: object) -> dict:
        assert method == "get_object"
        return {"Body": TrickleBody(self.data, self.step), "ETag": '"e1"'}


class FakeStorage:
    def __init__(self, fs: FakeS3) -> None:
        self.fs = fs

    def _p(self, path: str) -> str:
        return f"bucket/{path}"

    def uri(self, path: str) -> str:
        return f"s3://bucket/{path}"


LEASE = msgspec.json.encode(Lease(driver_id="d", host="h", pid=1, pid_started_at=1.0, acquired_at=1.0,
                                  renewed_at=1.0, ttl_s=10.0))


def test_a_lease_that_arrives_a_few_bytes_at_a_time_is_read_whole():
    got = S3Conditional(FakeStorage(FakeS3(LEASE, step=7))).read_versioned("run/driver_lease.json")
    assert got is not None and got.data == LEASE and got.whole and got.version == '"e1"'


def test_a_document_past_the_bound_is_read_no_further_than_one_byte_past_it():
    big = b"{" + b" " * (2 * r.MAX_SMALL_DOCUMENT_BYTES) + b"}"
    got = S3Conditional(FakeStorage(FakeS3(big, step=65536))).read_versioned("run/driver_lease.json")
    assert got is not None and not got.whole and len(got.data) == r.MAX_SMALL_DOCUMENT_BYTES + 1
