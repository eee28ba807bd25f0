"""Every error of an object store's client reaches outlast as a `StorageError` naming the call and the
path, so it is retried with backoff and reported as storage's; a refused permission is not retried."""

from __future__ import annotations

import pytest
from botocore.exceptions import EndpointConnectionError, NoCredentialsError

from outlast.storage.base import StorageError
from outlast.storage.remote import RemoteStorage
from outlast.storage.retry import transient


class Failing:
    """An fsspec file system whose every call raises `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __getattr__(self, name):
        def call(*args, **kwargs):
            raise self.error

        return call


CALLS = [("exists", ("run/x",)), ("list_dirs", ("run",)), ("delete", ("run/x",)), ("size", ("run/x",)),
         ("read_bytes", ("run/x",)), ("write_atomic", ("run/x", b"1"))]


@pytest.mark.parametrize("error", [EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), NoCredentialsError(),
                                   ConnectionResetError("reset by peer")], ids=["endpoint", "credentials", "reset"])
@pytest.mark.parametrize(("call", "args"), CALLS, ids=[c for c, _ in CALLS])
def test_a_client_error_is_a_storage_error_naming_the_call_and_the_path(call, args, error):
    storage = RemoteStorage("memory://bucket/exp")
    storage._fs = Failing(error)
    with pytest.raises(StorageError) as raised:
        getattr(storage, call)(*args)
    assert "memory://bucket/exp/run" in str(raised.value) and type(error).__name__ in str(raised.value)
    assert transient(raised.value)


def test_a_refused_permission_is_a_storage_error_that_is_not_retried():
    storage = RemoteStorage("memory://bucket/exp")
    storage._fs = Failing(PermissionError("AccessDenied"))
    with pytest.raises(StorageError) as raised:
        storage.delete("run/checkpoint_001_000000")
    assert isinstance(raised.value, PermissionError) and not transient(raised.value)


def test_a_missing_path_stays_what_it_was():
    storage = RemoteStorage("memory://bucket/exp")
    storage._fs = Failing(FileNotFoundError("run/x"))
    assert storage.list_dirs("run") == []
    storage.delete("run/x")
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("run/x")
    with pytest.raises(FileNotFoundError):
        storage.size("run/x")
