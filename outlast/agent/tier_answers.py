"""What the tier server's thread answers itself, each in a chunk's time at most: a peer's offer and the chunks
of its replica, fetches of a copy and of its chunks, commits, frees, the list of what is held.

An offer or a fetch opens a transfer (`tier_schedule.Transfers`) whose bytes go through the server's data
socket, sealed under a key of its own (`tier_client.TransferSealer`); a chunk is taken only within a transfer
this server opened, and only as far as the sizes its offer declared. A request that raises is answered with
the error (`failed`), and the transfer it belongs to ends with what it wrote.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import msgspec
import zmq

from outlast.agent.tier_client import (CHUNK, SERVER, TAG, WINDOW, Landing, TransferError, TransferSealer,
                                       digests_for, file_range, new_transfer, open_landing, refused)
from outlast.agent.tier_schedule import OpenTransfer, Transfers
from outlast.protocol import messages as m
from outlast.storage.memtier import CopyKey
from outlast.storage.tier_store import TierRecord, TierStore, os_failure

log = logging.getLogger("outlast.agent.tier")


class _Carrier:
    """A transfer's own on the server: its seal, and an offer's files open for writing and their checksums as
    its chunks are written."""

    def __init__(self, transfer: m.Transfer, landings: dict[str, Landing] | None = None,
                 files: Sequence[m.FileEntry] = ()) -> None:
        self.sealer = TransferSealer(transfer, SERVER)
        self.landings = landings or {}  # path -> where its chunks go
        self.digests = digests_for(list(files))
        # A fetch's chunks are sealed into these, made as needed, each again once zmq has sent what it held
        # (its tracker): one more than a fetcher's window, so a fetch makes no new pages after its first chunks.
        self.ring: list[bytearray | None] = [None] * (WINDOW + 1)
        self.trackers: list[zmq.MessageTracker | None] = [None] * (WINDOW + 1)
        self.turn = 0

    def seal_buffer(self) -> tuple[int, bytearray] | None:
        """The next buffer of the ring that zmq is done with (made if need be), or None: never waited for."""
        slot = self.turn % len(self.ring)
        tracker = self.trackers[slot]
        if tracker is not None and not tracker.done:
            return None
        self.turn += 1
        buffer = self.ring[slot]
        if buffer is None:
            buffer = self.ring[slot] = bytearray(CHUNK + TAG)
        return slot, buffer

    def close(self) -> None:
        for landing in self.landings.values():
            landing.close()
        self.landings = {}


class TierAnswers:
    """The server thread's answers on one node's tier. `lock` guards the store (the hold threads use it too);
    `transfers` is the server thread's alone."""

    def __init__(self, store: TierStore, lock: threading.Lock, transfers: Transfers[_Carrier],
                 data_address: str) -> None:
        self.store = store
        self._lock = lock
        self.transfers = transfers
        self.data_address = data_address
        # The server thread opens every chunk written through a buffer into this one: its pages stay made.
        self._buffer = bytearray(CHUNK)
        self._sealed: tuple[_Carrier, int] | None = None  # the ring buffer of the chunk being sent (`sent`)

    def let_go(self, transfer: OpenTransfer[_Carrier] | None) -> None:
        """A transfer ended without its copy kept: its files are closed, and what an offer wrote goes, with its
        bytes in the budget."""
        if transfer is None:
            return
        transfer.carrier.close()
        if transfer.is_offer:
            with self._lock:
                self.store.abort(transfer.key)

    def close(self) -> None:
        """The server stops: every transfer's files closed (what they wrote is reclaimed by the next agent)."""
        for transfer in self.transfers.all():
            transfer.carrier.close()

    def failed(self, ident: bytes, msg: m.TierRequest, e: Exception) -> m.TierStored:
        """The answer to a request that raised: the transfer it belongs to ends, and the error is said."""
        node = self.store.node_id
        if isinstance(e, OSError):
            why = os_failure(node, self.store.root, e)
        else:
            log.exception("the memory tier failed on %s", type(msg).__name__)
            why = f"the tier server of {node} failed: {type(e).__name__}: {e}"
        key = _named(msg)
        if isinstance(msg, (m.TierChunk, m.TierFetch)) and msg.session:
            self.let_go(self.transfers.end(msg.session))
        elif isinstance(msg, (m.TierOffer, m.TierOfferEnd)):
            self.let_go(self.transfers.end(self.transfers.offer_of(ident, key)))
            with self._lock:
                if isinstance(msg, m.TierOffer) and self.store.writing(key) and not self.transfers.receiving(key):
                    self.store.abort(key)  # begun by this offer, which failed before its transfer opened
        log.warning("a %s of %s rank %s failed: %s", type(msg).__name__, key.checkpoint_dir or "-", key.rank, why)
        return refused(key, node, why)

    def data(self, msg: m.TierRequest, head: bytes, sealed: memoryview | bytes, now: float,
             ) -> m.TierReply | list[bytes | memoryview] | None:
        """A chunk of an offer, or a fetch of one, on the data socket: only within a transfer this server opened."""
        self.sent(None)  # a chunk sealed last time whose frames never reached zmq (its send raised): let go
        if not isinstance(msg, (m.TierChunk, m.TierFetch)):
            return None  # nothing else is asked here, and the data socket answers no stranger more than it must
        key = CopyKey(msg.run, msg.checkpoint_dir, msg.rank)
        node = self.store.node_id
        transfer = self.transfers.touch(msg.session, key, now)
        if isinstance(transfer, str):
            return refused(key, node, transfer)
        if isinstance(msg, m.TierChunk) and transfer.is_offer:
            if msg.path not in (transfer.sizes or {}):
                return refused(key, node, f"no offer of {msg.path} is open")
            why = transfer.past_declared(msg.path, msg.offset, len(sealed) - TAG)
            if why is not None:
                self.let_go(self.transfers.end(msg.session))
                return refused(key, node, why)
            try:
                transfer.carrier.landings[msg.path].put(transfer.carrier.sealer, head, msg, sealed, self._buffer,
                                                        partial(transfer.carrier.digests.update, msg.path, msg.offset))
            except TransferError as e:
                # What failed its seal may have been opened into the file already: the transfer ends, and its
                # files go.
                self.let_go(self.transfers.end(msg.session))
                return refused(key, node, str(e))
            return m.TierAck(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=msg.rank, path=msg.path,
                             offset=msg.offset)
        if isinstance(msg, m.TierFetch) and not transfer.is_offer and msg.path:
            return self._chunk(transfer.key, transfer.carrier, msg)
        return refused(key, node, f"a {type(msg).__name__} does not belong on the data socket")

    def sent(self, tracker: zmq.MessageTracker | None) -> None:
        """The frames `data` answered with were given to zmq: the ring buffer they were sealed into (if any) is
        sealed into again once `tracker` says zmq is done with it (without one, never: it is let go to zmq)."""
        if self._sealed is not None:
            carrier, slot = self._sealed
            carrier.trackers[slot] = tracker
            if tracker is None:
                carrier.ring[slot] = None
            self._sealed = None

    def request(self, ident: bytes, msg: m.TierRequest, now: float) -> m.TierReply:
        """A request on the CURVE socket, other than the hold threads' (holds, pulls, uploads)."""
        node = self.store.node_id
        if isinstance(msg, m.TierList):
            with self._lock:
                copies = [m.TierCopyInfo(run=r.run, checkpoint_dir=r.checkpoint_dir, rank=r.rank, seq=r.seq,
                                         nbytes=r.nbytes, primary=r.primary, committed=r.committed)
                          for r in self.store.records()]
                return m.TierHoldings(node_id=node, budget_bytes=self.store.book.budget_bytes,
                                      used_bytes=self.store.book.used(), copies=copies,
                                      spare_bytes=self.store.spare_bytes())
        if isinstance(msg, m.TierCommit):
            with self._lock:
                self.store.mark_committed(msg.run, msg.checkpoint_dir)
            return m.TierAck(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=-1)
        if isinstance(msg, m.TierFree):
            for session in self.transfers.of_run(msg.run):
                self.let_go(self.transfers.end(session))
            with self._lock:
                self.store.free_run(msg.run)
            return m.TierAck(run=msg.run, checkpoint_dir="", rank=-1)
        key = CopyKey(msg.run, msg.checkpoint_dir, msg.rank)
        if isinstance(msg, m.TierOffer):
            return self._offer(ident, key, msg, now)
        if isinstance(msg, m.TierOfferEnd):
            offered = self.transfers.finish_offer(ident, key)
            if isinstance(offered, str):
                return refused(key, node, offered)
            offered.carrier.close()
            with self._lock:
                # The checksums of what came in order were computed as it was written: nothing is read again.
                why = self.store.finish(key, offered.carrier.digests.digests())
            return m.TierStored(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=msg.rank, node_id=node,
                                ok=why is None, reason=why or "")
        if isinstance(msg, m.TierFetch) and not msg.path:
            offer = self._record(key)
            if isinstance(offer, m.TierOffer):
                transfer = new_transfer(self.data_address)
                self.transfers.open(transfer.session, key, now, carrier=_Carrier(transfer))
                return msgspec.structs.replace(offer, transfer=transfer)
            return offer
        return refused(key, node, f"a {type(msg).__name__} goes to the data socket of the transfer it belongs to")

    def _offer(self, ident: bytes, key: CopyKey, msg: m.TierOffer, now: float) -> m.TierReply:
        with self._lock:
            admission, partial = self.store.begin(msg.run, msg.checkpoint_dir, msg.rank, msg.seq, msg.files,
                                                  msg.primary, reuse=True)
        if partial is None:
            return refused(key, self.store.node_id, admission.reason if not admission.admit else "already held")
        landings: dict[str, Landing] = {}
        try:
            for entry in msg.files:
                if entry.path in landings:
                    raise ValueError(f"file {entry.path} is offered twice")
                landings[entry.path] = open_landing(partial, entry)
        except (OSError, ValueError):
            for landing in landings.values():
                landing.close()
            with self._lock:
                self.store.abort(key)
            raise  # answered by `failed`, with the path and errno, once what was half-made is gone
        transfer = new_transfer(self.data_address)
        self.transfers.open(transfer.session, key, now, sender=ident, sizes={f.path: f.size for f in msg.files},
                            carrier=_Carrier(transfer, landings, msg.files))
        return m.TierAck(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=msg.rank, transfer=transfer)

    def _held(self, key: CopyKey) -> tuple[TierRecord, Path] | m.TierStored:
        """The record of the copy `key` and where its files are; or the answer that it is not held here."""
        with self._lock:
            record, where = self.store.record(key), self.store.path(key)
        if record is None or where is None:
            node = self.store.node_id
            return refused(key, node, f"{key.checkpoint_dir} rank {key.rank} is not held on {node}")
        return record, where

    def _record(self, key: CopyKey) -> m.TierOffer | m.TierStored:
        """A fetch without a path: the held copy's record."""
        held = self._held(key)
        if isinstance(held, m.TierStored):
            return held
        record, _ = held
        return m.TierOffer(run=key.run, checkpoint_dir=key.checkpoint_dir, rank=key.rank, seq=record.seq,
                           files=record.files, primary=record.primary)

    def _chunk(self, key: CopyKey, carrier: _Carrier, msg: m.TierFetch) -> m.TierStored | list[bytes | memoryview]:
        """A fetch of a chunk: its header and its bytes sealed, read from a map of that range of the file alone."""
        held = self._held(key)
        if isinstance(held, m.TierStored):
            return held
        record, where = held
        node = self.store.node_id
        if not any(f.path == msg.path for f in record.files):  # the copy's own files, nothing else under it
            return refused(key, node, f"{msg.path} is not a file of {msg.checkpoint_dir} rank {msg.rank}")
        if msg.offset < 0 or not 0 <= msg.length <= CHUNK:
            return refused(key, node, f"a fetch of {msg.length} bytes at {msg.offset} of {msg.path}: a chunk is at "
                                      f"most {CHUNK} bytes, from an offset in the file")
        chunk = m.TierChunk(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=msg.rank, path=msg.path,
                            offset=msg.offset)
        try:
            with file_range(where, msg.path, msg.offset, msg.length) as data:
                free = carrier.seal_buffer()
                if free is None:  # zmq still sends every buffer of the ring: this chunk's seal is a new one
                    return carrier.sealer.seal(chunk, data)
                slot, buffer = free
                frames = carrier.sealer.seal(chunk, data, buffer)
                self._sealed = (carrier, slot)
                return frames
        except (OSError, ValueError) as e:
            return refused(key, node, f"cannot read {msg.path}: {e}")


def _named(msg: m.TierRequest) -> CopyKey:
    """The copy a request names, as far as it names one: a commit names no rank (-1), a free no checkpoint (""),
    a list nothing."""
    if isinstance(msg, m.TierList):
        return CopyKey("", "", -1)
    if isinstance(msg, m.TierFree):
        return CopyKey(msg.run, "", -1)
    if isinstance(msg, m.TierCommit):
        return CopyKey(msg.run, msg.checkpoint_dir, -1)
    return CopyKey(msg.run, msg.checkpoint_dir, msg.rank)
