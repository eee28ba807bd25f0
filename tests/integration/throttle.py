"""A TCP proxy on loopback whose uploads go at a set rate: an object store with a thin uplink. What a
client sends through it is passed on at most `rate_bps` bytes a second (0: as fast as it comes), so a
large upload takes its time while a small write (a manifest, a run state) goes through at once."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class Throttle:
    def __init__(self, upstream: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.upstream = upstream
        self.rate_bps = 0.0
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._conns |= {client, server}
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, paced: bool) -> None:
        try:
            while data := src.recv(65536):
                if paced and self.rate_bps:
                    time.sleep(len(data) / self.rate_bps)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for s in conns:
            with contextlib.suppress(OSError):
                s.close()
