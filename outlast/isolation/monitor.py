"""Kernel event sources that wake the agent's loop when memory gets tight.

Each source is a file descriptor the agent polls with its sockets; `consume()` takes the event,
so that the descriptor is quiet until the next one. v2: inotify on memory.events (the kernel
notifies on every counter change) and a PSI trigger; v1: eventfds registered through
cgroup.event_control.
"""

from __future__ import annotations

import ctypes
import os
import select

_IN_MODIFY = 0x00000002
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC


class EventSource:
    name: str
    fd: int

    def consume(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class Inotify(EventSource):
    """IN_MODIFY on one file, e.g. user/memory.events (its `high` counter)."""

    def __init__(self, path: str, name: str) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_init1: {os.strerror(ctypes.get_errno())}")
        if libc.inotify_add_watch(fd, path.encode(), _IN_MODIFY) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}")
        self.fd, self.name = fd, name

    def consume(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)


class PsiTrigger(EventSource):
    """A PSI trigger (e.g. 'some 150000 1000000' on memory.pressure): the kernel raises POLLPRI.

    The trigger's fd is wrapped in an epoll set, whose own fd turns readable, so the agent's
    ZeroMQ poller (which knows only POLLIN for plain fds) can wait on it.
    """

    def __init__(self, path: str, trigger: str, name: str) -> None:
        self._file = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.write(self._file, trigger.encode() + b"\0")
            self._ep = select.epoll()
            self._ep.register(self._file, select.EPOLLPRI)
        except OSError:
            os.close(self._file)
            raise
        self.fd, self.name = self._ep.fileno(), name

    def consume(self) -> None:
        self._ep.poll(0)  # the event is edge-like per window; polling consumes it

    def close(self) -> None:
        self._ep.close()
        os.close(self._file)


class V1EventFd(EventSource):
    """cgroup v1 notification: an eventfd tied to a control file (and optional args) of a cgroup."""

    def __init__(self, cgroup_dir: str, control: str, args: str, name: str) -> None:
        self.fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._target = os.open(os.path.join(cgroup_dir, control), os.O_RDONLY | os.O_CLOEXEC)
        try:
            with open(os.path.join(cgroup_dir, "cgroup.event_control"), "w") as f:
                f.write(f"{self.fd} {self._target} {args}".strip())
        except OSError:
            self.close()
            raise
        self.name = name

    def consume(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass

    def close(self) -> None:
        # Closing the eventfd unregisters it in the kernel.
        for fd in (self.fd, self._target):
            try:
                os.close(fd)
            except OSError:
                pass


