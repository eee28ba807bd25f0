"""How a workload's request reaches its child without passing through the fork server.

The fork server's memory is every later child's: a fork copies it, pages and all, so a request
it once held (a run's credential, its pickled train function) could be read by a worker of
another run forked after it, from its own address space. So the agent writes each request to a
sealed memfd of its own and passes only the fd, beside the `ForkChild` the server needs to fork;
the server never reads it and closes its copy once the child has it, and the child reads it after
its fork. The bytes live in the agent, the memfd (until the child's read) and the child, nowhere else.
"""

from __future__ import annotations

import fcntl
import os

from outlast.protocol import messages as m
from outlast.protocol.transport import TO_CHILD, encode

# Sealed: what the child reads is what the agent wrote, whoever else holds the fd.
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def sealed(request: m.ForkWorker | m.ForkTask) -> int:
    """A memfd holding `request`, sealed; the caller passes it on and closes it."""
    fd = os.memfd_create("outlast-request", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(encode(request))
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read(fd: int) -> m.ForkWorker | m.ForkTask:
    """In the child: its request, from the memfd only it holds now; closes it."""
    try:
        size = os.fstat(fd).st_size
        chunks, done = [], 0
        while done < size:
            chunk = os.pread(fd, size - done, done)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
    finally:
        os.close(fd)
    return TO_CHILD.decode(b"".join(chunks))
