"""`outlast dashboard` as a process of its own, for the tests of its pages and of what it refuses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dashboard:
    def __init__(self, *args: str, host: str = "127.0.0.1", env: dict | None = None) -> None:
        self.port = free_port()
        self.host = host
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "outlast.cli.main", "dashboard", *args, "--host", host, "--port", str(self.port)],
            cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.banner = self.proc.stdout.readline()
        # Read on for as long as it runs: a pipe left full (its warnings of malformed requests) would
        # stop the server at its next line.
        self.output: list[str] = []
        threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True).start()
        self.url = f"http://{host}:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/static/app.js", timeout=5).read()
                break
            except urllib.error.HTTPError:
                break  # it answers (a token is needed)
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the dashboard did not start: {self.banner}{''.join(self.output)}") from None
                time.sleep(0.1)

    def get(self, path: str, **headers) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{self.url}{path}", headers=headers), timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
