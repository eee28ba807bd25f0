"""The chaos harness's object store: a moto S3 server, and a TCP proxy in front of it that the
harness can take down (an outage: connections refused, open ones reset) or slow down (each
request held for a while before it is passed on). Both listen on the cluster's bridge address,
which the driver in the root namespace and the workers in the members' namespaces all reach.

The outage is the proxy's, not moto's: moto keeps the bucket in memory, so killing it would lose
what a real store keeps across a restart. To a client the two are the same: the endpoint refuses
connections, then answers again with everything it held.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class DelayingProxy:
    def __init__(self, host: str, upstream: tuple[str, int]) -> None:
        self.host, self.upstream = host, upstream
        self.delay_s = 0.0
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = self._listen(0)

    def _listen(self, port: int) -> int:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, port))
        s.listen(128)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()
        return s.getsockname()[1]

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._conns |= {client, upstream}
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()
        self._pump(client, upstream, True)

    def _pump(self, src: socket.socket, dst: socket.socket, delayed: bool) -> None:
        try:
            while data := src.recv(65536):
                if delayed and self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
                with self._lock:
                    self._conns.discard(s)

    def down(self) -> None:
        """Refuse new connections and reset the open ones."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for s in conns:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()

    def up(self) -> None:
        if self._listener is None:
            self._listen(self.port)

    def close(self) -> None:
        self.down()


class ObjectStore:
    """moto on a port of its own, a bucket, and the proxy that clients are given."""

    def __init__(self, host: str, bucket: str = "chaos") -> None:
        from moto.server import ThreadedMotoServer

        with socket.socket() as s:
            s.bind((host, 0))
            moto_port = s.getsockname()[1]
        self.server = ThreadedMotoServer(ip_address=host, port=moto_port, verbose=False)
        self.server.start()
        self.direct = f"http://{host}:{moto_port}"
        self.proxy = DelayingProxy(host, (host, moto_port))
        self.endpoint = f"http://{host}:{self.proxy.port}"
        self.bucket = bucket
        self.client().create_bucket(Bucket=bucket)

    def client(self):
        """A client that goes around the proxy: the harness's own reads see no fault."""
        import boto3

        return boto3.client("s3", endpoint_url=self.direct, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def read(self, key: str) -> bytes | None:
        try:
            return self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as e:  # noqa: BLE001 - a missing key is None; anything else too, the caller asks again
            if "NoSuchKey" in repr(e) or "404" in repr(e):
                return None
            raise

    def keys(self, prefix: str) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def close(self) -> None:
        self.proxy.close()
        self.server.stop()
