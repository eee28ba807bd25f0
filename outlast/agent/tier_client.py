"""Moving a copy between two nodes' tier servers: asked over CURVE, its bytes sealed on a plain socket.

The offer or the fetch goes over the tier server's CURVE socket (the cluster key), and its answer
gives a `Transfer`: the server's data socket and a key made for this one copy. The chunks then go
through the data socket, each sealed with AES-256-GCM under that key (`TransferSealer`), its header the
associated data, so that a chunk changed, moved to another file or offset, or sent under another
transfer is refused. CURVE encrypts in ZeroMQ's one I/O thread of each side; AES-GCM with the
CPU's AES instructions, in the threads that read and write the files, moved a replica 1.6 times as
fast (`git show 85019e9:bench/results/tier-transport-before.json` beside that commit's tier-transport.json),
and the checkpoint's bytes are the whole of the traffic.

Both directions go in chunks of `CHUNK` bytes with at most `WINDOW` unanswered, so a server's
thread never holds more than a chunk of anyone's copy and never waits on a slow peer; a peer
silent for `timeout_s` fails the transfer, saying so.

A chunk's bytes travel as a frame of their own after its `TierChunk` (`TransferSealer.seal`), never
inside the msgpack: they are sealed straight from a map of the file (the page cache, or the tier's
tmpfs; a fetch's holder maps each chunk's range alone) into one of a few buffers the sender uses
again (new pages for every chunk cost more than the encryption), and the receiver opens each seal
straight into its place, a map of that chunk's range of the file, where the file's pages are there
already (a spare file of the tier's: `TierStore.begin`), else into one reused buffer that is
written into the file (`Landing`). The checksum of what came is
taken in that same pass, from the bytes just opened (`InOrderDigests`): nothing is read again to
check the copy. So the copies on the way are the seal's, the kernel's socket, and the opening of
the seal into the file (with a write from the buffer where the file's pages are new).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import NamedTuple

import msgspec
import zmq
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.protocol.transport import TIER_REPLIES, connect_dealer, encode
from outlast.storage import safepath
from outlast.storage.checksum import InOrderDigests, new_hasher
from outlast.storage.memtier import CopyKey

CHUNK = 8 << 20
WINDOW = 4
TAG = 16  # AES-GCM's tag: a sealed chunk is its bytes and this


class TransferError(RuntimeError):
    """A copy could not be sent to or fetched from a peer; the message says why."""


# Each side seals with nonces of its own (its role's first byte, then its count), so that the two sides
# never seal under one nonce, and a chunk sent back to its sender does not open.
ASKER, SERVER = 0, 1


class _Buffers:
    """Rings of buffers a replica is sealed into, kept for the next one: a new ring is WINDOW + 1 chunks of pages
    to make (0.1 s of a 1 GiB replica's 0.7 here), and replicas follow one another all run long. At most one ring
    is kept (40 MiB): a second replica at once makes its own, which goes when it ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[bytearray] | None = None

    def take(self) -> list[bytearray]:
        with self._lock:
            ring, self._kept = self._kept, None
        return ring if ring is not None else [bytearray(CHUNK + TAG) for _ in range(WINDOW + 1)]

    def give(self, ring: list[bytearray]) -> None:
        with self._lock:
            self._kept = ring


_SEAL_BUFFERS = _Buffers()


def new_transfer(data_address: str) -> m.Transfer:
    return m.Transfer(data_address=data_address, session=os.urandom(16), key=AESGCM.generate_key(256))


def refused(key: CopyKey, node_id: str, reason: str, seconds: float = 0.0) -> m.TierStored:
    """The answer of `node_id`'s tier to a request about the copy `key` that it did not carry out, saying why."""
    return m.TierStored(run=key.run, checkpoint_dir=key.checkpoint_dir, rank=key.rank, node_id=node_id, ok=False,
                        reason=reason, seconds=seconds)


class TransferSealer:
    """One side of a transfer: seals what it sends under the transfer's key, with a nonce it never uses
    again, and opens what the other side sent."""

    def __init__(self, transfer: m.Transfer, side: int) -> None:
        self.session = transfer.session
        self._aead = AESGCM(transfer.key)
        self._side = side
        self._sent = 0

    def seal(self, chunk: m.TierChunk, data: memoryview | bytes,
             out: bytearray | None = None) -> list[bytes | memoryview]:
        """The chunk's frames: its header (this transfer's, with the next nonce), then its bytes sealed (into the
        start of `out` when given, which must hold them and their tag)."""
        self._sent += 1
        head = encode(msgspec.structs.replace(chunk, session=self.session, nonce=self._sent))
        if out is None:
            return [head, self._aead.encrypt(_nonce(self._side, self._sent), data, head)]
        if len(out) < len(data) + TAG:
            raise ValueError(f"a buffer of {len(out)} bytes cannot hold a sealed chunk of {len(data)}")
        sealed = memoryview(out)[:len(data) + TAG]
        self._aead.encrypt_into(_nonce(self._side, self._sent), data, head, sealed)
        return [head, sealed]

    def open(self, head: bytes, chunk: m.TierChunk, sealed: memoryview | bytes,
             out: memoryview | None = None) -> bytes | memoryview:
        """The bytes of a chunk the other side sealed (opened into `out` when given, which must be their size);
        TransferError if they or their header changed. What was opened into `out` is not the chunk then: the
        caller drops it."""
        if out is not None and len(out) != len(sealed) - TAG:
            raise TransferError(f"a chunk of {chunk.path} at {chunk.offset} has {max(len(sealed) - TAG, 0)} bytes, "
                                f"where {len(out)} were expected: refused")
        try:
            if out is None:
                return self._aead.decrypt(_nonce(1 - self._side, chunk.nonce), sealed, head)
            self._aead.decrypt_into(_nonce(1 - self._side, chunk.nonce), sealed, head, out)
            return out
        except (InvalidTag, OverflowError):  # OverflowError: a nonce no count of ours reaches (negative, or past 88 bits)
            raise TransferError(f"a chunk of {chunk.path} at {chunk.offset} failed its seal (changed on the way, "
                                "or not of this transfer): refused") from None


class Landing:
    """A file of a copy being received, `size` bytes (set here: a reused file's pages past it go back, a new
    file's are made as chunks come). Where every page of the file is there already (a spare file of the
    tier's), each chunk goes straight into a map of its own range, made for it and unmade after (so that a
    chunk costs the server's thread its own pages' time, whatever the file's size): overwriting a page
    allocates nothing, so a full tmpfs cannot fault the map. Elsewhere it goes into a buffer the caller
    reuses and is written from there: into pages not yet made a write is cheaper than faults through a map
    (1.5 GB/s through the map against 2.1 written, here), and a full tmpfs is then the write's ENOSPC.
    Either way `seen` is given the bytes as they now are in the file, to hash while they are at hand."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        self.mapped = size > 0 and os.fstat(fd).st_blocks * 512 >= size

    def put(self, sealer: TransferSealer, head: bytes, chunk: m.TierChunk, sealed: memoryview | bytes,
            buffer: bytearray, seen: Callable[[memoryview], None]) -> None:
        """Open a chunk's seal into its place; TransferError where it fails (what it opened into the file is not
        the chunk's: the caller drops the file), or where the chunk lies outside the file."""
        length = len(sealed) - TAG
        if length < 0 or chunk.offset < 0 or chunk.offset + length > self.size:
            raise TransferError(f"a chunk of {chunk.path} at {chunk.offset} ({max(length, 0)} bytes) lies outside "
                                f"its file's {self.size} bytes: refused")
        with self._place(chunk.offset, length, buffer) as out:
            sealer.open(head, chunk, sealed, out)
            if not self.mapped:
                write_all(self.fd, out, chunk.offset)
            seen(out)

    def read_from(self, src: int, offset: int, length: int, buffer: bytearray,
                  seen: Callable[[memoryview], None]) -> None:
        """Read `length` bytes at `offset` of the file `src` (a rank's) into their place here, in the kernel
        (which lets go of the GIL, as a copy between two maps would not)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"{length} bytes at {offset} lie outside a file of {self.size} bytes")
        with self._place(offset, length, buffer) as out:
            done = 0
            while done < length:
                n = os.preadv(src, [out[done:]], offset + done)
                if n == 0:
                    raise OSError(errno.EIO, f"a file being copied ended {offset + done} bytes in, before its size")
                done += n
            if not self.mapped:
                write_all(self.fd, out, offset)
            seen(out)

    @contextmanager
    def _place(self, offset: int, length: int, buffer: bytearray) -> Iterator[memoryview]:
        """Where `length` bytes at `offset` go: a map of that range of the file, or the start of `buffer`."""
        if self.mapped and length:
            with _range_map(self.fd, offset, length, writable=True) as out:
                yield out
            return
        if length > len(buffer):
            raise TransferError(f"{length} bytes do not fit a buffer of {len(buffer)}: more than a chunk")
        with memoryview(buffer)[:length] as out:
            yield out

    def close(self) -> None:
        os.close(self.fd)


def _nonce(side: int, count: int) -> bytes:
    return bytes([side]) + count.to_bytes(11, "big")


def _recv(sock: zmq.Socket[bytes], timeout_s: float, what: str) -> m.TierReply:
    return _recv_sealed(sock, timeout_s, what)[1]


def file_view(root: Path | str, rel: str, owner: int | None = None) -> memoryview:
    """The bytes of the file `rel` under `root` (no link followed, a file of `owner`'s when given: `safepath`),
    mapped (nothing read into a buffer); empty for an empty file. The map is closed when the last slice of it
    is let go, by zmq once a frame made of it is sent."""
    with safepath.opened(root, rel, owner=owner) as f:
        size = os.fstat(f.fileno()).st_size
        return memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)) if size else memoryview(b"")


@contextmanager
def file_range(root: Path | str, rel: str, offset: int, length: int) -> Iterator[memoryview]:
    """The bytes of the file `rel` under `root` (no link followed: `safepath`) from `offset`, `length` at most
    (fewer at its end), from a map of that range alone, its pages mapped at once (cheaper than a fault for
    each, and a chunk's time whatever the file's size); unmapped at the block's end."""
    with safepath.opened(root, rel) as f:
        size = os.fstat(f.fileno()).st_size
        length = max(0, min(length, size - offset))
        if length == 0:
            yield memoryview(b"")
            return
        with _range_map(f.fileno(), offset, length, writable=False) as view:
            yield view


@contextmanager
def _range_map(fd: int, offset: int, length: int, writable: bool) -> Iterator[memoryview]:
    """`length` bytes of the file `fd` at `offset`, from a map of that range alone (from the allocation granularity
    below it), its pages mapped at once; unmapped at the block's end."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    pages = mmap.mmap(fd, offset + length - start, offset=start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    try:
        with memoryview(pages) as whole, whole[offset - start:] as view:
            yield view
    finally:
        pages.close()


def _chunks(files: list[m.FileEntry]) -> Iterator[tuple[m.FileEntry, int, int]]:
    for entry in files:
        for offset in range(0, max(entry.size, 1), CHUNK):
            yield entry, offset, min(CHUNK, entry.size - offset)


def push(sock: zmq.Socket[bytes], key: CopyKey, seq: int, files: list[m.FileEntry], src: Path, peer: str,
         timeout_s: float = 30.0, turn: Callable[[], None] | None = None, owner: int | None = None) -> m.TierStored:
    """Send the files under `src` (each of `owner`'s, when given) to the tier server behind `sock` as a
    replica; its answer at the end. `turn`, called before each chunk, returns when the replica may go on."""
    sock.send(encode(m.TierOffer(run=key.run, checkpoint_dir=key.checkpoint_dir, rank=key.rank, seq=seq,
                                 files=files, primary=False)))
    reply = _recv(sock, timeout_s, peer)
    if isinstance(reply, m.TierStored):
        return reply  # refused: its reason says why
    if not isinstance(reply, m.TierAck) or reply.transfer is None:
        raise TransferError(f"{peer} answered an offer with {type(reply).__name__} and no transfer")
    sealer = TransferSealer(reply.transfer, ASKER)
    data = connect_dealer(sock.context, reply.transfer.data_address)
    # One buffer more than the chunks unanswered: a buffer is sealed into again once zmq has let its frame go
    # (its tracker), which an answer to its chunk says it has, so the wait below is for a frame's last bytes.
    ring = _SEAL_BUFFERS.take()
    trackers: list[zmq.MessageTracker | None] = [None] * len(ring)
    try:
        in_flight = 0
        views: dict[str, memoryview] = {}
        for n, (entry, offset, length) in enumerate(_chunks(files)):
            view = views.get(entry.path)
            if view is None:
                view = views[entry.path] = file_view(src, entry.path, owner)
            if len(view) < offset + length:
                raise TransferError(f"file {entry.path} under {src} is shorter than its record says")
            while in_flight >= WINDOW:
                _expect_ack(_recv(data, timeout_s, peer), peer)
                in_flight -= 1
            if turn is not None:
                turn()
            slot = n % len(ring)
            tracker = trackers[slot]
            if tracker is not None and not tracker.done:
                try:
                    tracker.wait(timeout_s)
                except zmq.NotDone:
                    raise TransferError(f"a chunk to {peer} was not sent in {timeout_s:.0f} s") from None
            frames = sealer.seal(m.TierChunk(run=key.run, checkpoint_dir=key.checkpoint_dir, rank=key.rank,
                                             path=entry.path, offset=offset), view[offset:offset + length], ring[slot])
            trackers[slot] = data.send_multipart(frames, copy=False, track=True)
            in_flight += 1
        while in_flight:
            _expect_ack(_recv(data, timeout_s, peer), peer)
            in_flight -= 1
    finally:
        data.close(linger=0)
        if all(t is None or t.done for t in trackers):  # else zmq may still read one: it goes with its frame
            _SEAL_BUFFERS.give(ring)
    sock.send(encode(m.TierOfferEnd(run=key.run, checkpoint_dir=key.checkpoint_dir, rank=key.rank)))
    reply = _recv(sock, timeout_s, peer)
    if not isinstance(reply, m.TierStored):
        raise TransferError(f"{peer} answered the end of a copy with {type(reply).__name__}")
    return reply


def _expect_ack(reply: m.TierReply, peer: str) -> None:
    if isinstance(reply, m.TierStored):
        raise TransferError(f"{peer} stopped taking the copy: {reply.reason}")
    if not isinstance(reply, m.TierAck):
        raise TransferError(f"{peer} answered a chunk with {type(reply).__name__}")


def digests_for(files: list[m.FileEntry]) -> InOrderDigests:
    """Checksums of `files` as their chunks are written (an entry without one is refused where it is checked)."""
    return InOrderDigests({f.path: (f.checksum[0], f.size) for f in files if f.xxh3_128 or f.sha256})


class Fetched(NamedTuple):
    offer: m.TierOffer  # the copy's record, whose checksums the caller checks
    digests: dict[str, str]  # of the bytes written, by path (`InOrderDigests`): what that check need not read


def fetch(ctx: zmq.Context[zmq.Socket[bytes]], key_pair: ClusterKey | None, address: str, key: CopyKey,
          dest: Path | Callable[[m.TierOffer], Path], timeout_s: float = 30.0) -> Fetched:
    """Copy a peer's held copy into `dest` (created), or where `dest(its record)` says (it raises
    TransferError to refuse)."""
    sock = connect_dealer(ctx, address, key=key_pair)
    data = None
    try:
        sock.send(encode(m.TierFetch(run=key.run, checkpoint_dir=key.checkpoint_dir, rank=key.rank)))
        offer = _recv(sock, timeout_s, address)
        if isinstance(offer, m.TierStored):
            raise TransferError(offer.reason)
        if not isinstance(offer, m.TierOffer) or offer.transfer is None:
            raise TransferError(f"{address} answered a fetch with {type(offer).__name__} and no transfer")
        sealer = TransferSealer(offer.transfer, ASKER)
        data = connect_dealer(ctx, offer.transfer.data_address)
        where = dest(offer) if callable(dest) else dest
        where.mkdir(parents=True, exist_ok=True)
        landings: dict[str, Landing] = {}
        buffer = bytearray(CHUNK)
        digests = digests_for(offer.files)
        pending = list(_chunks(offer.files))
        asked = 0
        asked_for: dict[tuple[str, int], int] = {}
        try:
            for entry in offer.files:
                if entry.path in landings:
                    raise TransferError(f"{address} offered file {entry.path} twice")
                landings[entry.path] = open_landing(where, entry)
            done = 0
            while done < len(pending):
                while asked < len(pending) and asked - done < WINDOW:
                    entry, offset, length = pending[asked]
                    data.send(encode(m.TierFetch(run=key.run, checkpoint_dir=key.checkpoint_dir, rank=key.rank,
                                                 path=entry.path, offset=offset, length=length,
                                                 session=sealer.session)))
                    asked_for[(entry.path, offset)] = length
                    asked += 1
                head, chunk, sealed = _recv_sealed(data, timeout_s, address)
                if isinstance(chunk, m.TierStored):
                    raise TransferError(chunk.reason)
                if not isinstance(chunk, m.TierChunk) or chunk.path not in landings:
                    raise TransferError(f"{address} answered a chunk request with {type(chunk).__name__}")
                if asked_for.pop((chunk.path, chunk.offset), None) != len(sealed) - TAG:
                    # The copy's room was made for its declared sizes: nothing else is written.
                    raise TransferError(f"{address} sent {max(len(sealed) - TAG, 0)} bytes of {chunk.path} at "
                                        f"{chunk.offset}, which were not asked for")
                landings[chunk.path].put(sealer, head, chunk, sealed, buffer,
                                         partial(digests.update, chunk.path, chunk.offset))
                done += 1
        finally:
            for landing in landings.values():
                landing.close()
        return Fetched(offer, digests.digests())
    finally:
        sock.close(linger=0)
        if data is not None:
            data.close(linger=0)


def open_landing(where: Path, entry: m.FileEntry) -> Landing:
    """The file `entry` under `where` (the tier's own room for a copy), opened to receive its chunks: a spare
    file the tier placed there is written over in place (`safepath.open_under`'s `keep`)."""
    fd = safepath.open_under(where, entry.path, write=True, keep=True)
    try:
        return Landing(fd, entry.size)
    except BaseException:
        os.close(fd)
        raise


def copy_checked(src_root: str, entry: m.FileEntry, where: Path, owner: int | None = None) -> str:
    """Copy the file `entry` from under `src_root` (a file of `owner`'s, when given) to the same place under
    `where` (written over a spare file placed there: `open_landing`), and return the checksum of the bytes
    written, taken as they are written (by `entry`'s algorithm): the copy is checked against its record
    without being read again. ValueError where the file's size is not the record's."""
    algorithm = entry.checksum[0]
    src = safepath.open_under(src_root, entry.path, owner=owner)
    try:
        size = os.fstat(src).st_size
        if size != entry.size:
            raise ValueError(f"file {entry.path} has {size} bytes, the record says {entry.size}")
        hasher = new_hasher(algorithm)
        landing = open_landing(where, entry)
        try:
            buffer = bytearray(0 if landing.mapped else min(CHUNK, size))
            for offset in range(0, size, CHUNK):
                landing.read_from(src, offset, min(CHUNK, size - offset), buffer, hasher.update)
        finally:
            landing.close()
        return hasher.hexdigest()
    finally:
        os.close(src)


def _recv_sealed(sock: zmq.Socket[bytes], timeout_s: float, what: str) -> tuple[bytes, m.TierReply, memoryview | bytes]:
    """An answer on a data socket: its header as it came (a seal's associated data), decoded, and what follows."""
    if not sock.poll(int(timeout_s * 1000)):
        raise TransferError(f"no answer from {what} for {timeout_s:.0f} s")
    frames = sock.recv_multipart(copy=False)
    head = frames[0].bytes
    return head, TIER_REPLIES.decode(head), frames[1].buffer if len(frames) > 1 else b""


def write_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def ask(ctx: zmq.Context[zmq.Socket[bytes]], key_pair: ClusterKey, address: str, msg: m.Msg, timeout_s: float = 600.0) -> m.TierReply:
    """One request, one answer (a hold is answered once the replica is on the peer, or has failed)."""
    sock = connect_dealer(ctx, address, key=key_pair)
    try:
        sock.send(encode(msg))
        return _recv(sock, timeout_s, address)
    finally:
        sock.close(linger=0)

