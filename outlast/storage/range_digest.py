"""The checksum of a file downloaded in ranges, taken as the ranges land rather than after the last one.

A large file comes down as ranges fetched side by side, which land in any order; xxh3 is a streaming hash
over the bytes in order. `PrefixCursor` (pure) keeps the contiguous prefix that has landed and says which
ranges join it in order; `RangeDigest` feeds those ranges to the hasher from the buffers the download
already holds (or, past a bound on what it holds, from the written file's pages, still in the page cache).
Feeding happens on the download's own threads, one at a time: the thread whose range extends the prefix
hashes what it joined while the others keep fetching, so when the last range lands only that range, and
whatever waited behind a straggler, is left to hash. The check against the manifest then reads nothing back.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from outlast.storage.checksum import ALGORITHM, new_hasher

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer as Buffer

# What a file's digest may keep of ranges that landed past a gap, waiting for it to fill: about what the
# ranges in flight hold (s3_bulk: 16 of 16 MiB). A range beyond it is read back from the file instead.
HOLD = 256 << 20
_READ_BACK = 4 << 20


class PrefixCursor:
    """Which ranges of a file of `size` bytes have landed, as the prefix [0, prefix) that is whole and the
    ranges past it that wait for a gap to fill. Pure: no I/O, no locks."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.prefix = 0
        self._past: dict[int, int] = {}  # start -> end of each range landed past the prefix

    @property
    def complete(self) -> bool:
        return self.prefix == self.size

    def land(self, start: int, end: int) -> list[tuple[int, int]]:
        """Record range [start, end); return the ranges, in order, that the prefix grew by (this one and
        those that waited behind it), empty when a gap still lies before it. ValueError for a range that is
        empty, outside the file, or overlaps one landed before: bytes hashed twice would give a wrong digest."""
        if not 0 <= start < end <= self.size:
            raise ValueError(f"range [{start}, {end}) is not a range of a file of {self.size} bytes")
        if start < self.prefix or any(start < e and s < end for s, e in self._past.items()):
            raise ValueError(f"range [{start}, {end}) overlaps bytes that landed before")
        self._past[start] = end
        joined = []
        while self.prefix in self._past:
            end_of = self._past.pop(self.prefix)
            joined.append((self.prefix, end_of))
            self.prefix = end_of
        return joined


class RangeDigest:
    """The xxh3-128 (outlast's `ALGORITHM`) of the file at `path`, `size` bytes, from its ranges as they land.
    Call `landed` once for each range after its bytes are written into the file; thread-safe."""

    def __init__(self, path: Path, size: int, hold: int = HOLD) -> None:
        self.path = path
        self._cursor = PrefixCursor(size)
        self._hasher = new_hasher(ALGORITHM)
        self._hold = hold
        self._held = 0  # bytes of the buffers kept below
        self._waiting: dict[int, Buffer | None] = {}  # start -> buffer of each range landed past the prefix
        self._ready: collections.deque[tuple[int, int, Buffer | None]] = collections.deque()  # to hash, in order
        self._feeding = False  # a thread is in `_feed`
        self._failed = False
        self._lock = threading.Lock()

    def landed(self, start: int, end: int, data: Buffer | None) -> None:
        """Range [start, end) is in the file. `data`: its bytes as written, hashed from memory; None to read
        them back from the file. This thread then hashes whatever joined the prefix, unless another one is
        hashing already: that one takes it, in order."""
        with self._lock:
            joined = self._cursor.land(start, end)
            if data is not None and not joined and self._held + (end - start) > self._hold:
                data = None  # a gap holds up the prefix, and enough is waiting already: read back later
            self._waiting[start] = data
            self._held += end - start if data is not None else 0
            self._ready.extend((s, e, self._waiting.pop(s)) for s, e in joined)
            if self._feeding:
                return
            self._feeding = True
        self._feed()

    def _feed(self) -> None:
        while True:
            with self._lock:
                if not self._ready or self._failed:
                    self._feeding = False
                    return
                start, end, data = self._ready.popleft()
            whole = False
            try:
                if data is None:
                    whole = self._read_back(start, end)
                else:
                    self._hasher.update(data)
                    whole = True
            finally:
                with self._lock:
                    self._held -= end - start if data is not None else 0
                    if not whole:
                        self._failed = True  # bytes are missing from the hash: `hexdigest` gives None from now on
                        self._feeding = False
            if not whole:
                return

    def _read_back(self, start: int, end: int) -> bool:
        """Bytes [start, end) of the file into the hash; False when the file ends before `end` (another
        writer cut it: whoever checks it finds its size)."""
        buf = bytearray(min(_READ_BACK, end - start))
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while start < end:
                n = os.preadv(fd, [memoryview(buf)[:end - start]], start)
                if n == 0:
                    return False
                self._hasher.update(memoryview(buf)[:n])
                start += n
            return True
        finally:
            os.close(fd)

    def hexdigest(self) -> str | None:
        """The file's digest once every range has landed and been hashed; None before that, or when hashing
        failed (whoever checks the file then reads it whole)."""
        with self._lock:
            if not self._cursor.complete or self._ready or self._feeding or self._failed:
                return None
            return self._hasher.hexdigest()
