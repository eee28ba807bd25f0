"""A restore being fetched, told to the driver while it goes on (its progress line,
outlast/controller/progress.py): a thread of the worker watches the bytes the download has put
on disk so far and sends `RestoreProgress` on a connection of its own (a ZeroMQ socket belongs
to one thread), never touching the fetch itself: a first report as the fetch starts, one every
`EVERY_S`, a last one when it is done.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path

import zmq

from outlast.protocol import messages as m
from outlast.protocol.run_credential import worker_key
from outlast.protocol.transport import connect_dealer, send_or_drop
from outlast.storage.base import Storage
from outlast.storage.run_store import RunStore

EVERY_S = 0.5


def _fetched(cache_root: Path, name: str) -> int:
    """Bytes on disk in the partial downloads of `name` on this node (outlast/storage/restore.py): the
    ranks of a node share one download, and the others wait for it."""
    total = 0
    for partial in cache_root.glob(f"*/.{name}.partial-*"):
        for root, _dirs, files in os.walk(partial):
            for f in files:
                try:
                    total += os.stat(os.path.join(root, f)).st_size
                except OSError:
                    pass
    return total


@contextmanager
def reporting_fetch(storage: Storage, run_dir: str, name: str, cache_root: Path, controller_address: str,
                    attempt: int, rank: int):
    """Around a restore's fetch: its progress reaches the controller while it lasts."""
    store = RunStore(storage, run_dir)
    if not controller_address or storage.local_path(store.path(name)) is not None:
        yield  # read where it lies: nothing to fetch
        return
    stop = threading.Event()
    thread = threading.Thread(target=_report, name="outlast-fetch-progress", daemon=True,
                              args=(store, name, cache_root, controller_address, attempt, rank, stop))
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5.0)


def _report(store: RunStore, name: str, cache_root: Path, address: str, attempt: int, rank: int,
            stop: threading.Event) -> None:
    try:
        manifest = store.read_manifest(name)
    except Exception:  # the fetch itself will say what is wrong with it
        return
    total = sum(f.size for f in manifest.files) if manifest is not None else 0
    ctx = zmq.Context()
    sock = connect_dealer(ctx, address, f"{attempt}:{rank}:fetch".encode(), key=worker_key())

    def send(finished: bool) -> None:
        done = total if finished else _fetched(cache_root, name)
        # Dropped on a full queue (the driver that far behind, or gone): each one says all the earlier ones did,
        # so the next replaces it, and the fetch never waits on the driver.
        send_or_drop(sock, m.RestoreProgress(attempt=attempt, rank=rank, checkpoint_dir=name, fetched_bytes=done,
                                             total_bytes=total, finished=finished))

    try:
        send(False)  # before anything else, however fast the fetch: the driver sees it begin and end
        while not stop.wait(EVERY_S):
            send(False)
        send(True)
    except zmq.ZMQError:
        pass
    finally:
        sock.close(linger=1000)
        ctx.term()
