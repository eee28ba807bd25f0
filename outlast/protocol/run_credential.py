"""A run's own credential: how its workers reach their driver without the cluster's key.

The driver makes a CURVE client keypair for the run and admits its public key on its own
sockets only. A worker holds that keypair and the cluster's public key (to know it talks to the
real driver). Agents admit only the cluster's key, so a worker, its user code and whatever
reads its environment can reach this run's driver and nothing else of the cluster.
"""

from __future__ import annotations

import os

import zmq
from zmq.auth.thread import ThreadAuthenticator

from outlast.protocol.auth import ClusterKey, admit

CREDENTIAL_ENV = "OUTLAST_RUN_CREDENTIAL"


class RunCredential:
    def __init__(self, server_public: bytes, secret: bytes) -> None:
        self.server_public = server_public
        self.secret = secret
        self.public = zmq.curve_public(secret)

    @classmethod
    def generate(cls, cluster: ClusterKey) -> "RunCredential":
        _public, secret = zmq.curve_keypair()
        return cls(cluster.public, secret)

    @classmethod
    def from_env(cls) -> "RunCredential | None":
        text = os.environ.get(CREDENTIAL_ENV)
        if not text:
            return None
        return cls.decode(text)

    @classmethod
    def decode(cls, text: str) -> "RunCredential":
        server_public, _, secret = text.partition(" ")  # z85 has no space
        return cls(server_public.encode(), secret.encode())

    @property
    def env(self) -> dict[str, str]:
        return {CREDENTIAL_ENV: f"{self.server_public.decode()} {self.secret.decode()}"}

    def connect_as_client(self, sock: zmq.Socket[bytes]) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def worker_key() -> "RunCredential | ClusterKey | None":
    """What a worker connects to its driver with: its run's credential (a node started by an older
    driver may still hand it the cluster key)."""
    return RunCredential.from_env() or ClusterKey.from_env()


def issue(auth: ThreadAuthenticator, cluster: ClusterKey) -> RunCredential:
    """A new credential for one run, admitted on the sockets of `auth`'s context (its `env` gives it
    to the run's workers)."""
    credential = RunCredential.generate(cluster)
    admit(auth, credential.public)
    return credential
