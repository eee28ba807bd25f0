"""Rank 0's return value, kept on storage and read back by the driver whose workers wrote it.

The value is a pickle, and unpickling runs code. Whoever can write the storage path must not be
able to run code in the driver, so the file is sealed: an HMAC of the pickle under a key derived
from the run's credential (protocol/run_credential.py), which only the driver and its own
workers hold. The driver unpickles only what carries its key's seal; anything else (a file
written by hand, by another run, or by an earlier driver of the same run, whose credential
died with it) is not a return value, and `Result.return_value` is None.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import TYPE_CHECKING, Any

import cloudpickle

from outlast.storage.records import MAX_DOCUMENT_BYTES, RETURN_VALUE_NAME, DocumentTooLarge
from outlast.storage.run_store import read_document

if TYPE_CHECKING:
    from outlast.storage.base import Storage
    from outlast.storage.run_store import RunStore

log = logging.getLogger("outlast.train")

MAGIC = b"outlast-return-value-1\n"
MAC_BYTES = 32


def key_from_secret(secret: bytes) -> bytes:
    """The sealing key, from the run credential's secret: a key of its own, not the secret itself."""
    return hashlib.blake2b(secret, digest_size=32, person=b"outlast-retval").digest()


def seal(pickled: bytes, key: bytes) -> bytes:
    return MAGIC + hmac.digest(key, pickled, "sha256") + pickled


def unseal(data: bytes, key: bytes) -> bytes | None:
    """The pickle inside `data` when `key` sealed it; None otherwise."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + MAC_BYTES:
        return None
    mac, pickled = data[len(MAGIC):len(MAGIC) + MAC_BYTES], data[len(MAGIC) + MAC_BYTES:]
    return pickled if hmac.compare_digest(mac, hmac.digest(key, pickled, "sha256")) else None


def read(storage: Storage, store: RunStore, key: bytes | None) -> Any:
    """The value rank 0 returned, when this driver's own workers sealed it; None otherwise, with the reason logged."""
    path = store.path(RETURN_VALUE_NAME)
    where = storage.uri(path)
    if key is None:
        if storage.exists(path):
            log.info("the return value at %s is read only by the driver whose workers wrote it; "
                     "Result.return_value is None here", where)
        return None
    try:
        data = read_document(storage, path, MAX_DOCUMENT_BYTES)
    except FileNotFoundError:
        return None
    except DocumentTooLarge:
        log.warning("the return value at %s is larger than %d bytes; Result.return_value is None",
                    where, MAX_DOCUMENT_BYTES)
        return None
    pickled = unseal(data, key)
    if pickled is None:
        log.warning("the return value at %s was not written by this driver's workers (its seal does not match); "
                    "it is not unpickled, and Result.return_value is None", where)
        return None
    try:
        return cloudpickle.loads(pickled)
    except Exception as e:
        log.warning("could not read the train function's return value at %s: %s", where, e)
        return None
