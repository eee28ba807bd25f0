"""Uploads that must go first: the just-in-time checkpoint of a preemption notice.

An upload started inside `urgent()` runs its files on a pool of its own, and while one
is in progress, every other upload's files wait before they start (a file already on
its way finishes). A notice's checkpoint therefore gets the disk and the network to
itself instead of queueing behind an older checkpoint's bytes; the older one resumes
after it and still commits.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

_state = threading.local()
_gate = threading.Condition()
T = TypeVar("T")
_urgent_uploads = 0
_pools: dict[bool, ThreadPoolExecutor] = {}


def _pool(urgent: bool) -> ThreadPoolExecutor:
    # Created on first use, never at import: a process that forks workers must have no threads.
    with _gate:
        if urgent not in _pools:
            _pools[urgent] = ThreadPoolExecutor(max_workers=max(8, 2 * (os.cpu_count() or 1)),
                                                thread_name_prefix="outlast-io-urgent" if urgent else "outlast-io")
        return _pools[urgent]


@contextlib.contextmanager
def urgent() -> Iterator[None]:
    """Uploads started by this thread inside the block go first."""
    global _urgent_uploads
    with _gate:
        _urgent_uploads += 1
    _state.urgent = True
    try:
        yield
    finally:
        _state.urgent = False
        with _gate:
            _urgent_uploads -= 1
            _gate.notify_all()


def is_urgent() -> bool:
    return getattr(_state, "urgent", False)


def urgent_pending() -> int:
    with _gate:
        return _urgent_uploads


def _after_urgent(fn: Callable[..., T], *args: Any) -> T:
    with _gate:
        _gate.wait_for(lambda: _urgent_uploads == 0)
    return fn(*args)


def submit(fn: Callable[..., T], *args: Any) -> Future[T]:
    """Run fn(*args) on the I/O pool of the calling thread's priority."""
    if is_urgent():
        return _pool(True).submit(fn, *args)
    return _pool(False).submit(_after_urgent, fn, *args)


def io_pool() -> ThreadPoolExecutor:
    """The I/O pool for work that no upload waits behind (restores, downloads)."""
    return _pool(True)
