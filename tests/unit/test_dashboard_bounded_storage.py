"""The dashboard's reads of storage documents stop at their size limit, on S3 (moto on loopback)
as on a local directory."""

from __future__ import annotations

import pytest

from outlast.cli.dashboard.bounded import BoundedStorage, DocumentRefused
from outlast.storage import open_storage


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_document_over_the_limit_is_refused_before_it_is_read_and_one_within_is_read_whole(where, tmp_path,
                                                                                            request):
    if where == "s3":
        request.getfixturevalue("s3")
    inner = open_storage(str(tmp_path) if where == "local" else "s3://runs/bounded")
    inner.write_atomic("run/small.json", b"x" * 100)
    inner.write_atomic("run/big.json", b"y" * 101)
    storage = BoundedStorage(inner, limit=100)
    assert storage.read_bytes("run/small.json") == b"x" * 100
    with pytest.raises(DocumentRefused, match=r"run/big.json is 101 bytes, more than the dashboard reads of one "
                                              r"document \(100 bytes\)"):
        storage.read_bytes("run/big.json")
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("run/missing.json")
    assert storage.list_dirs("") == ["run"]  # the rest is the store's own
