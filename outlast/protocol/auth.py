"""The cluster key: CURVE encryption and authentication for every socket between machines.

A cluster key is one CURVE secret key, made by the head at start and given to every
agent and driver that joins. All members use the keypair it defines: as servers, and
as clients, which the server's authenticator admits only with that public key. So a
peer without the key cannot complete a handshake, and nothing it sends is ever read.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from outlast.statedir import UnsafeStateError, check_secret_file, write_secret_file

log = logging.getLogger("outlast.protocol")


SECRET_ENV = "OUTLAST_CLUSTER_SECRET"


class AuthError(RuntimeError):
    """A peer refused our cluster key (or we have none for a cluster that needs one)."""


class ClusterKey:
    def __init__(self, secret: bytes) -> None:
        try:
            self.public = zmq.curve_public(secret)
        except (zmq.ZMQError, ValueError) as e:
            raise AuthError(f"not a valid cluster key ({e}); copy the key file from the head again") from None
        self.secret = secret

    @classmethod
    def generate(cls) -> "ClusterKey":
        _public, secret = zmq.curve_keypair()
        return cls(secret)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "ClusterKey":
        try:
            check_secret_file(Path(path))
            return cls(Path(path).read_bytes().strip())
        except UnsafeStateError as e:
            raise AuthError(str(e)) from None
        except FileNotFoundError:
            raise AuthError(f"no cluster key at {path}: copy it from the head node (it is written there at "
                            "`outlast start`), or pass --cluster-key") from None

    @classmethod
    def from_env(cls) -> "ClusterKey | None":
        """The key a worker inherits from its agent ($OUTLAST_CLUSTER_SECRET)."""
        secret = os.environ.get(SECRET_ENV)
        return cls(secret.encode()) if secret else None

    @property
    def env(self) -> dict[str, str]:
        """What to put in a child's environment so that `from_env` finds the key there."""
        return {SECRET_ENV: self.secret.decode()}

    def save(self, path: str | os.PathLike[str]) -> None:
        write_secret_file(Path(path), self.secret + b"\n")

    def serve(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` (before bind) a CURVE server."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def connect_as_client(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` (before connect) a CURVE client of a server holding the same key."""
        sock.curve_serverkey = self.public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def start_authenticator(ctx: zmq.Context[zmq.Socket[bytes]], key: ClusterKey) -> ThreadAuthenticator:
    """Admit only clients that present the cluster's public key; stop it at shutdown."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("outlast.protocol.zap"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_OnlyKey(key.public))
    return auth


def admit(auth: ThreadAuthenticator, public: bytes) -> None:
    """Admit one more client key on the sockets of `auth`'s context (a run's own credential)."""
    auth.credentials_providers["*"].others.add(public)


class _OnlyKey:
    def __init__(self, public: bytes) -> None:
        self.public = public
        self.others: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key == self.public or key in self.others
        if not allowed:
            log.warning("refused a connection with the wrong cluster key")
        return allowed


def connect_checked(sock: zmq.Socket[bytes], address: str, timeout_ms: int) -> None:
    """Connect and wait until the handshake with the server succeeds; raise `AuthError` if it fails.

    Without this a client with the wrong key would only see silence.
    """
    # A wrong key fails the cryptographic handshake itself (no detail); a known key that the
    # server's authenticator refuses fails with an auth status.
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    try:
        sock.connect(address)
        if not monitor.poll(timeout_ms):
            raise AuthError(f"no handshake with {address} within {timeout_ms / 1000:.0f} s "
                            "(is it running, and does it use a cluster key?)")
        if recv_monitor_message(monitor)["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED:
            raise AuthError(f"{address} refused this cluster key; use the key file of the cluster's head node")
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
