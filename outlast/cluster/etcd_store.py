"""The cluster store in etcd: one client over the cluster's endpoints, its lease, its watch.

Talks to etcd's JSON gateway (`/v3/...`) through etcd3gw's HTTP session, so no gRPC stubs and no
protobuf version are imposed on a training environment. A call goes to the current endpoint and
moves on to the next when that one cannot be reached; `StoreUnavailable` means none answered
(no majority, or no member reachable). etcd's own TLS and user/password are passed through;
they are etcd's credentials, never outlast's: outlast processes trust one another by the cluster
key alone, and each cluster's keys live under a prefix derived from the key's public half.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlparse

from outlast.cluster.sealed import Sealer
from outlast.cluster.store_view import StoreEvent

if TYPE_CHECKING:
    from etcd3gw.client import Etcd3Client

log = logging.getLogger("outlast.store")

CALL_TIMEOUT_S = 2.0  # one request to one member; a member without a majority answers no sooner


class StoreUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class EtcdConfig:
    endpoints: list[str]
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    lease_ttl_s: int = 3

    @classmethod
    def parse(cls, urls: str, cacert: str | None = None, cert: str | None = None, key: str | None = None,
              user: str | None = None, password: str | None = None, lease_ttl_s: int = 3) -> "EtcdConfig":
        """From `--etcd URL[,URL...]` and the TLS/auth flags; ValueError says what to fix."""
        endpoints = []
        for url in (u.strip() for u in urls.split(",") if u.strip()):
            if "://" not in url:
                url = f"{'https' if cacert or cert else 'http'}://{url}"
            p = urlparse(url)
            if p.scheme not in ("http", "https") or not p.hostname or not p.port:
                raise ValueError(f"--etcd {url!r}: give etcd client URLs as http(s)://HOST:PORT, comma-separated "
                                 "(e.g. http://10.0.0.1:2379,http://10.0.0.2:2379)")
            endpoints.append(url)
        if not endpoints:
            raise ValueError("--etcd needs at least one client URL (http://HOST:2379)")
        if (cert is None) != (key is None):
            raise ValueError("--etcd-cert and --etcd-key go together: give both, or neither")
        for flag, path in (("--etcd-cacert", cacert), ("--etcd-cert", cert), ("--etcd-key", key)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file")
        if user and not password:
            raise ValueError(f"--etcd-user {user}: set its password in $OUTLAST_ETCD_PASSWORD")
        if lease_ttl_s < 2:
            raise ValueError(f"the etcd lease must last at least 2 s (etcd's own minimum), got {lease_ttl_s}")
        return cls(endpoints, cacert, cert, key, user, password, lease_ttl_s)

    def env(self) -> dict[str, str]:
        """For the processes a node starts that read the store too (drivers find it from here)."""
        out = {"OUTLAST_ETCD": ",".join(self.endpoints), "OUTLAST_ETCD_LEASE_TTL_S": str(self.lease_ttl_s)}
        for name, value in (("CACERT", self.cacert), ("CERT", self.cert), ("KEY", self.key), ("USER", self.user),
                            ("PASSWORD", self.password)):
            if value:
                out[f"OUTLAST_ETCD_{name}"] = value
        return out

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "EtcdConfig | None":
        e = os.environ if environ is None else environ
        if not e.get("OUTLAST_ETCD"):
            return None
        return cls.parse(e["OUTLAST_ETCD"], e.get("OUTLAST_ETCD_CACERT"), e.get("OUTLAST_ETCD_CERT"),
                         e.get("OUTLAST_ETCD_KEY"), e.get("OUTLAST_ETCD_USER"), e.get("OUTLAST_ETCD_PASSWORD"),
                         int(e.get("OUTLAST_ETCD_LEASE_TTL_S", "3")))


def namespace_of(public_key: bytes) -> str:
    """The prefix of one cluster's keys: clusters with different keys share an etcd without meeting."""
    return f"/outlast/{hashlib.sha256(public_key).hexdigest()[:16]}/"


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _range_end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class EtcdStore:
    """Calls to etcd under one cluster's prefix, failing over between endpoints."""

    def __init__(self, config: EtcdConfig, namespace: str, timeout_s: float = CALL_TIMEOUT_S,
                 sealer: Sealer | None = None) -> None:
        """With a `sealer`, every value written is sealed with the cluster key (outlast/cluster/sealed.py),
        and a `ClusterView(store.sealer)` refuses what is not."""
        self.sealer = sealer
        try:
            import etcd3gw  # noqa: F401
        except ImportError:
            raise StoreUnavailable("--etcd needs the etcd client library: pip install 'outlast[etcd]'") from None
        self.config, self.prefix, self.timeout_s = config, namespace, timeout_s
        self._current = 0
        self._lock = threading.Lock()  # the session's auth header and the current endpoint
        self._clients = [self._client(url) for url in config.endpoints]

    def _client(self, url: str) -> Etcd3Client:
        import requests
        from etcd3gw.client import Etcd3Client

        session = requests.Session()
        if self.config.cacert:
            session.verify = self.config.cacert
            # Else $REQUESTS_CA_BUNDLE (set on many machines) overrides the session's CA, and etcd's
            # own CA is not in the system bundle.
            session.trust_env = False
        if self.config.cert and self.config.key:
            session.cert = (self.config.cert, self.config.key)
        p = urlparse(url)
        if p.hostname is None or p.port is None:
            raise ValueError(f"etcd endpoint {url!r} names no host or no port: give http(s)://HOST:PORT")
        return Etcd3Client(host=p.hostname, port=p.port, protocol=p.scheme, timeout=self.timeout_s, api_path="/v3/",
                           session=session)

    # ---- calls --------------------------------------------------------------------------

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to `/v3/{path}` on the current endpoint, then each other in turn."""
        from etcd3gw import exceptions as ex

        errors = []
        start = self._current
        for i in range(len(self._clients)):
            n = (start + i) % len(self._clients)
            client = self._clients[n]
            try:
                try:
                    self._authenticate(client)
                    out: dict[str, Any] = client.post(client.get_url(path), json=body)
                except ex.Etcd3Exception as e:
                    if not (self.config.user and "token" in str(e)):
                        raise
                    client.session.headers.pop("Authorization", None)  # etcd's tokens expire: take a new one
                    self._authenticate(client)
                    out = client.post(client.get_url(path), json=body)
                self._current = n
                return out
            except (ex.ConnectionFailedError, ex.ConnectionTimeoutError, ex.InternalServerError) as e:
                errors.append(f"{self.config.endpoints[n]}: {_short(e)}")
            except ex.Etcd3Exception as e:
                raise StoreUnavailable(f"etcd refused {path}: {_short(e)}") from None
        raise StoreUnavailable("no etcd member answered with a majority behind it (" + "; ".join(errors) + ")")

    def _authenticate(self, client: Etcd3Client) -> None:
        if not self.config.user or "Authorization" in client.session.headers:
            return
        token = client.post(client.get_url("auth/authenticate"),
                            json={"name": self.config.user, "password": self.config.password})["token"]
        client.session.headers["Authorization"] = token

    def read_all(self, serializable: bool = False) -> tuple[list[tuple[str, bytes]], int]:
        """Every key of the cluster (relative to its prefix) and the revision they were read at."""
        out = self.call("kv/range", {"key": _b64(self.prefix), "range_end": _b64(_range_end(self.prefix)),
                                     "serializable": serializable})
        items = [(_unb64(kv["key"]).decode()[len(self.prefix):], _unb64(kv.get("value", "")))
                 for kv in out.get("kvs", [])]
        return items, int(out["header"]["revision"])

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        body: dict[str, Any] = {"key": _b64(self.prefix + key), "value": _b64(self._seal(key, value))}
        if lease:
            body["lease"] = lease
        self.call("kv/put", body)

    def delete(self, key: str) -> None:
        self.call("kv/deleterange", {"key": _b64(self.prefix + key)})

    def create(self, key: str, value: bytes, lease: int) -> bool:
        """Put `key` only if it does not exist (an election held by a lease); True when this call made it."""
        k = _b64(self.prefix + key)
        out = self.call("kv/txn", {"compare": [{"key": k, "result": "EQUAL", "target": "CREATE",
                                                "create_revision": "0"}],
                                   "success": [{"request_put": {"key": k, "value": _b64(self._seal(key, value)),
                                                                "lease": lease}}],
                                   "failure": []})
        return bool(out.get("succeeded"))

    def _seal(self, key: str, value: bytes) -> bytes:
        return self.sealer.seal(key, value) if self.sealer is not None else value

    def grant(self, ttl_s: int) -> int:
        return int(self.call("lease/grant", {"TTL": ttl_s})["ID"])

    def keep_alive(self, lease: int) -> bool:
        """Renew the lease; False when it has already ended (its keys are gone)."""
        out = self.call("lease/keepalive", {"ID": lease})
        return int(out.get("result", {}).get("TTL", -1)) > 0

    def revoke(self, lease: int) -> None:
        self.call("kv/lease/revoke", {"ID": lease})

    def probe(self) -> None:
        """A read that needs a majority: raises `StoreUnavailable` without one."""
        self.call("kv/range", {"key": _b64(self.prefix + "head"), "count_only": True})

    # ---- the watch ----------------------------------------------------------------------

    def watch(self, from_revision: int, on_events: Callable[[list[StoreEvent]], None],
              stopping: threading.Event) -> None:
        """Stream the prefix's changes from `from_revision` until the stream breaks or `stopping` is set."""
        client = self._clients[self._current]
        self._authenticate(client)
        body: dict[str, dict[str, str | int | bool]] = {"create_request": {"key": _b64(self.prefix), "range_end": _b64(_range_end(self.prefix)),
                                   "start_revision": from_revision, "progress_notify": True}}
        resp = client.session.post(client.get_url("watch"), json=body, stream=True, timeout=(self.timeout_s, 15))
        self._watch_response = resp
        try:
            for line in resp.iter_lines():
                if stopping.is_set():
                    return
                if not line.strip():
                    continue
                result = json.loads(line).get("result", {})
                if result.get("canceled") or result.get("compact_revision"):
                    return  # compacted past us: the caller reads everything again
                events = [StoreEvent(_unb64(e["kv"]["key"]).decode()[len(self.prefix):],
                                     None if e.get("type") == "DELETE" else _unb64(e["kv"].get("value", "")))
                          for e in result.get("events", [])]
                if events:
                    on_events(events)
        finally:
            resp.close()

    def stop_watch(self) -> None:
        resp = getattr(self, "_watch_response", None)
        if resp is not None:
            try:
                resp.raw._fp.fp.raw._sock.shutdown(2)  # wakes the reader blocked on the stream
            except Exception:  # noqa: BLE001 - already closed, or another transport: the read times out instead
                pass


def _short(e: BaseException) -> str:
    """etcd's or the network's reason (etcd3gw keeps it in `detail_text`), cut to one readable length."""
    text = getattr(e, "detail_text", None) or " ".join(str(a) for a in e.args) or type(e).__name__
    if "SSL" in text:  # a refused client certificate, an unknown CA: say it is TLS, then the detail
        text = "TLS failed: " + text[text.find("SSL"):]
    return " ".join(text.split())[:200]


__all__ = ["EtcdConfig", "EtcdStore", "StoreUnavailable", "namespace_of"]
