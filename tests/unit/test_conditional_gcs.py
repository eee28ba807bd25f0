"""GCS's compare-and-swap: generation preconditions, against an in-memory stand-in of its JSON API."""

from __future__ import annotations

import json

from outlast.storage.conditional import SMALL, GCSConditional, gcs_upload_params


class HttpError(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"HTTP {code}")
        self.code = code


class FakeGCS:
    """Objects with generations; uploads honour ifGenerationMatch as GCS does (0: must not exist)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], tuple[bytes, int]] = {}
        self.next_generation = 1700000000000001
        self.ranges: list[str | None] = []

    def __call__(self, method, url, *args, **params):
        if method == "GET":
            bucket, key = args
            if (bucket, key) not in self.objects:
                raise FileNotFoundError(f"{bucket}/{key}")
            data, generation = self.objects[(bucket, key)]
            self.ranges.append(params.get("headers", {}).get("Range"))
            if self.ranges[-1] is not None:  # "bytes=0-N", as GCS honours it
                last = int(self.ranges[-1].removeprefix("bytes=0-"))
                if not data:
                    raise HttpError(416)
                data = data[:last + 1]
            return {"x-goog-generation": str(generation)}, data
        (bucket,) = args
        key, want = params["name"], params["ifGenerationMatch"]
        have = self.objects.get((bucket, key), (b"", 0))[1]
        if want != have:
            raise HttpError(412)
        self.next_generation += 1
        self.objects[(bucket, key)] = (params["data"], self.next_generation)
        return {}, json.dumps({"name": key, "generation": str(self.next_generation)}).encode()


class Storage:
    def _p(self, path: str) -> str:
        return f"bucket/runs/{path}"

    def uri(self, path: str) -> str:
        return f"gs://bucket/runs/{path}"


def test_a_create_asks_for_generation_zero_and_a_replace_for_the_generation_read():
    assert gcs_upload_params("k", None)["ifGenerationMatch"] == 0
    assert gcs_upload_params("k", "1700000000000002")["ifGenerationMatch"] == 1700000000000002


def test_gcs_creates_only_what_is_absent_and_replaces_only_the_generation_read():
    cas = GCSConditional(Storage(), call=FakeGCS())
    assert cas.read_versioned("lease") is None
    first = cas.write_if("lease", b"one", None)
    assert first is not None and cas.write_if("lease", b"two", None) is None
    assert cas.read_versioned("lease") == (b"one", first)
    second = cas.write_if("lease", b"three", first)
    assert second not in (None, first)
    assert cas.write_if("lease", b"four", first) is None
    assert cas.read_versioned("lease").data == b"three"


def test_a_read_asks_for_no_more_than_a_small_document_and_an_empty_one_reads_as_empty():
    gcs = FakeGCS()
    cas = GCSConditional(Storage(), call=gcs)
    big = cas.write_if("lease", b"x" * (SMALL + 100), None)
    read = cas.read_versioned("lease")
    assert read == (b"x" * (SMALL + 1), big) and not read.whole  # cut, and known to be cut
    assert gcs.ranges == [f"bytes=0-{SMALL}"]
    empty = cas.write_if("empty", b"", None)
    assert cas.read_versioned("empty") == (b"", empty)
