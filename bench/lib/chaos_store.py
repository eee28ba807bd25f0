"""The chaos harness's object store: an S3 server process (`bench/lib/chaos_s3.py`, moto) that the
harness kills and starts again on the same port with the same data (an outage: connections
refused, open ones reset), or slows down (each request held for a while before it is carried
out). It listens on the cluster's bridge address, which the driver in the root namespace and the
workers in the members' namespaces all reach.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.venvs import ROOT


class ObjectStore:
    """The server, a bucket, and what clients are given to reach them."""

    def __init__(self, host: str, bucket: str = "chaos", workdir: Path | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="outlast-chaos-s3-") if workdir is None else None
        self.dir = Path(workdir or self._tmp.name)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.host, self.bucket = host, bucket
        with socket.socket() as s:
            s.bind((host, 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._standby: subprocess.Popen | None = None
        self.restarts = 0
        try:
            self.start()
            self.client().create_bucket(Bucket=bucket)
        except BaseException:
            self.close()
            raise

    # ---- the faults -----------------------------------------------------------------------------

    def _spawn(self, standby: bool) -> subprocess.Popen:
        log = open(self.dir / "server.log", "ab")
        try:
            return subprocess.Popen([sys.executable, "-m", "bench.lib.chaos_s3", self.host, str(self.port), str(self.dir),
                                     *(["--standby"] if standby else [])], cwd=ROOT, stdout=log, stderr=log,
                                    stdin=subprocess.PIPE if standby else subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the server on its port; it replays what it held before it listens. The next one
        waits, imported, to be started by the next call."""
        (self.dir / "ready").unlink(missing_ok=True)
        self.restarts += self.proc is not None
        if self._standby is not None and self._standby.poll() is None:
            self.proc, self._standby = self._standby, None
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()
        else:
            self.proc = self._spawn(standby=False)
        deadline = time.monotonic() + timeout_s
        while not (self.dir / "ready").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the S3 server did not start on {self.endpoint}; see {self.dir / 'server.log'}:\n"
                                   + (self.dir / "server.log").read_text(errors="replace")[-3000:])
            time.sleep(0.02)
        self._standby = self._spawn(standby=True)

    def kill(self) -> None:
        """SIGKILL the server: its port refuses connections until `start`."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.start()

    @property
    def delay_s(self) -> float:
        try:
            return float((self.dir / "delay").read_text())
        except (FileNotFoundError, ValueError):
            return 0.0

    @delay_s.setter
    def delay_s(self, seconds: float) -> None:
        tmp = self.dir / "delay.tmp"
        tmp.write_text(str(seconds))
        os.replace(tmp, self.dir / "delay")

    # ---- clients ----------------------------------------------------------------------------

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
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

    def delete(self, prefix: str) -> None:
        keys = self.keys(prefix)
        for i in range(0, len(keys), 1000):
            self.client().delete_objects(Bucket=self.bucket,
                                         Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})

    def close(self) -> None:
        self.kill()
        if self._standby is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._standby.pid, signal.SIGKILL)
            self._standby.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
