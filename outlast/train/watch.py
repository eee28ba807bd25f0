"""A rank's watch thread: its progress to the controller, and its stacks when the controller finds a hang.

Progress is what the loop already does: every call of report(), get_preemption_info(), a
collective, or `outlast.train.heartbeat()` counts. The thread sends the count when it has
changed, at most once a second, so the controller sees progress even while
get_preemption_info() answers from its grant with no message, and a stuck rank sends nothing.

The stacks come from `faulthandler.dump_traceback(all_threads=True)`, run by this thread when
the controller asks (`DumpStacks`). Why this and not a signal or py-spy: the agent started the
worker and the controller did not, and outlast signals only processes it started; py-spy reads
another process's memory through ptrace, which a container or Yama (ptrace_scope >= 1) refuses
without privileges; and a thread of the worker itself needs neither. It runs while the main
thread waits in a collective, in sleep, in I/O or in a Python loop (each lets the GIL go); a
native call that holds the GIL forever keeps it from answering, and the controller says so
("rank N sent no stacks") instead of guessing.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import tempfile
import threading
from typing import Callable

import zmq

from outlast.protocol import messages as m
from outlast.protocol.run_credential import worker_key
from outlast.protocol.transport import (TO_WORKER, BadMessage, connect_dealer, encode, incarnation_from_env,
                                       watch_identity)

log = logging.getLogger("outlast.worker")

INTERVAL_S = 1.0


def start(attempt: int, rank: int, controller_address: str, count: Callable[[], int]) -> threading.Event:
    """Start the thread; set the returned event to stop it."""
    stop = threading.Event()
    main = threading.main_thread().ident
    t = threading.Thread(target=_run, args=(attempt, rank, controller_address, count, stop, main),
                         name="outlast-watch", daemon=True)
    t.start()
    return stop


def _run(attempt: int, rank: int, address: str, count: Callable[[], int], stop: threading.Event,
         main: int | None) -> None:
    ctx = zmq.Context.instance()
    sock = connect_dealer(ctx, address, watch_identity(attempt, rank, incarnation_from_env()), key=worker_key())
    sent = -1
    try:
        while not stop.is_set():
            now = count()
            if now != sent:
                sock.send(encode(m.Progress(attempt=attempt, rank=rank, count=now)))
                sent = now
            if sock.poll(int(INTERVAL_S * 1000)):
                try:
                    msg = TO_WORKER.decode(sock.recv())
                except BadMessage as e:
                    log.warning("the watch thread dropped a malformed message: %s", e)
                    continue
                if isinstance(msg, m.DumpStacks):
                    text, where = dump(main)
                    sock.send(encode(m.StackDump(attempt=attempt, rank=rank, text=text, where=where)))
    finally:
        sock.close(linger=1000)


def dump(main: int | None) -> tuple[str, str]:
    """Every thread's stack as faulthandler writes it, and the innermost frame of the main thread."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        text = f.read()
    frame = sys._current_frames().get(main) if main is not None else None
    where = "unknown"
    if frame is not None:
        code = frame.f_code
        where = f"{code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})"
    return text, where
