"""A rank's checkpoint uploads: in the training thread (SYNC) or behind it (ASYNC, and
staged saves that write their files off the training thread too).

One background upload at a time keeps local disk use bounded, except for the checkpoint
that answers a preemption notice: it starts at once, goes first (`storage.priority`),
and the older upload resumes after it. Every upload's bytes and time feed the rank's
measured bandwidth, which reports carry so the controller can tell how long a pending
upload will take.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import zmq

from outlast.faults import fault_point
from outlast.protocol import messages as m
from outlast.protocol.run_credential import worker_key
from outlast.protocol.transport import connect_dealer, encode
from outlast.storage import priority
from outlast.storage.base import Storage
from outlast.storage.retry import upload_with_retries
from outlast.storage.local import walk_files

log = logging.getLogger("outlast.worker")



def dir_bytes(path: str | os.PathLike[str]) -> int:
    return sum(e.stat().st_size for e in Path(path).rglob("*") if e.is_file())


def local_files(path: str | os.PathLike[str]) -> list[m.FileEntry]:
    """The files under `path` as an upload of it will name them: '/'-separated relative paths, sizes."""
    files, _ = walk_files(Path(path))
    return [m.FileEntry(path=rel, size=(Path(path) / rel).stat().st_size) for rel in files]


class Uploads:
    def __init__(self, storage: Storage, controller_address: str, attempt: int, rank: int) -> None:
        self._storage = storage
        self._address = controller_address
        self._attempt, self._rank = attempt, rank
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: list[Future] = []
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._sock_lock = threading.Lock()
        self.bandwidth_bps = 0.0  # of this rank's last upload; 0 until one is measured

    def upload(self, local_dir: str, dest: str, move: bool, urgent: bool) -> list[m.FileEntry]:
        """In the calling thread; timed for the bandwidth figure."""
        nbytes, started = dir_bytes(local_dir), time.monotonic()
        with priority.urgent() if urgent else nullcontext():
            # Ranks share the checkpoint directory. Where two write one file, storage keeps rank 0's
            # copy whatever the order: rank 0 replaces, the others only create what is absent.
            files = upload_with_retries(self._storage, local_dir, dest, move=move, replace=self._rank == 0)
        elapsed = time.monotonic() - started
        if nbytes and elapsed > 0:
            self.bandwidth_bps = nbytes / elapsed
        return files

    def start(self, index: int, name: str, dest: str, delete: bool, urgent: bool,
              local_dir: str | None = None, write: Callable[[Path], None] | None = None) -> None:
        """Upload in the background: `local_dir` as it is, or a new staging directory that
        `write(dir)` fills first (a staged save: the files are written off the training thread)."""
        if not urgent:
            self.wait()  # one at a time, bar a notice's checkpoint
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="outlast-upload")
        self._in_flight.append(self._pool.submit(self._run, index, name, dest, delete, urgent, local_dir, write))

    def _run(self, index, name, dest, delete, urgent, local_dir, write) -> None:
        files, error = [], None
        try:
            if write is not None:
                local_dir = tempfile.mkdtemp(prefix=f"outlast-staged-{name}-")
                write(Path(local_dir))
            files = self.upload(local_dir, dest, move=delete, urgent=urgent)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            log.error("rank %d could not upload checkpoint %s: %s", self._rank, name, error)
        if local_dir is not None and delete and (error is None or write is not None):
            shutil.rmtree(local_dir, ignore_errors=True)
        done = m.UploadDone(attempt=self._attempt, rank=self._rank, index=index, checkpoint_dir=name,
                            files=files, error=error)
        if fault_point("upload.done_message"):
            return  # lost, as at an exit that throws the socket's queue away
        # The training thread has its own socket; upload threads share this one, one at a time.
        with self._sock_lock:
            if self._sock is None:
                # A context of its own, terminated in close(): only a terminated context waits for its
                # sockets' queued messages, and the worker's exit would drop the last UploadDone.
                self._ctx = zmq.Context()
                self._sock = connect_dealer(self._ctx, self._address, key=worker_key())
            self._sock.send(encode(done))

    def wait(self) -> None:
        while self._in_flight:
            self._in_flight.pop(0).result()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
        if self._sock is not None:
            # Its last UploadDone must get out before we exit, even while a loaded machine slows
            # the handshake of this new socket; a worker that is done has nothing else to wait for.
            self._sock.close(linger=10000)
            assert self._ctx is not None
            self._ctx.term()  # returns once the last UploadDone is out, or the linger is over
