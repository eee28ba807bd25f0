"""Every record outlast keeps in etcd is sealed with the cluster key: a MAC, checked on read.

Anyone who can write to etcd (plain http, a shared etcd, a leaked etcd password) could otherwise
add nodes that drivers place ranks on, or drains that stop every run. A record is
`mac1:<HMAC-SHA256 hex>:<body>`, the MAC over the record's key and its body, keyed by a key
derived from the cluster's secret: only a holder of the cluster key can make one, and a record
moved to another key (drains/a copied to drains/b) fails too. Pure; deletions carry no value
and so no MAC (etcd's own authentication is what guards them).
"""

from __future__ import annotations

import hashlib
import hmac

_TAG = b"mac1:"
_HEX = 64


class Sealer:
    def __init__(self, cluster_secret: bytes) -> None:
        self._key = hashlib.sha256(b"outlast etcd records\0" + cluster_secret).digest()

    def _mac(self, key: str, body: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + body, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, body: bytes) -> bytes:
        return _TAG + self._mac(key, body) + b":" + body

    def open(self, key: str, value: bytes) -> tuple[bytes | None, str]:
        """(the body, "") when `value` was sealed for `key` with this cluster's key; else (None, why)."""
        if not value.startswith(_TAG) or len(value) < len(_TAG) + _HEX + 1 or value[len(_TAG) + _HEX:][:1] != b":":
            return None, "it carries no MAC (written by something other than an outlast of this cluster)"
        mac, body = value[len(_TAG):len(_TAG) + _HEX], value[len(_TAG) + _HEX + 1:]
        if not hmac.compare_digest(mac, self._mac(key, body)):
            return None, "its MAC is wrong (written without this cluster's key, or moved from another key)"
        return body, ""
