"""What the tier server's thread answers itself, each in a chunk's time at most: a peer's offer and the chunks
of its replica, fetches of a copy and of its chunks, commits, frees, the list of what is held.

An offer or a fetch opens a transfer (`tier_schedule.Transfers`) whose bytes go through the server's data
socket, sealed under a key of its own (`tier_client.TransferSealer`); a chunk is taken only within a transfer
this server opened, and only as far as the sizes its offer declared. A request that raises is answered with
the error (`failed`), and the transfer it belongs to ends with what it wrote.
"""

from __future__ import annotations

import logging
import os
import threading

import msgspec

from outlast.agent.tier_client import (SERVER, TransferError, TransferSealer, digests_for, file_view, new_transfer,
                                       write_all)
from outlast.agent.tier_schedule import OpenTransfer, Transfers
from outlast.protocol import messages as m
from outlast.storage import safepath
from outlast.storage.memtier import CopyKey
from outlast.storage.tier_store import TierStore, os_failure

log = logging.getLogger("outlast.agent.tier")


class _Carrier:
    """A transfer's own on the server: its seal, and an offer's files open for writing and their checksums as
    its chunks are written."""

    def __init__(self, transfer: m.Transfer, fds: dict[str, int] | None = None, files: list[m.FileEntry] = ()) -> None:
        self.sealer = TransferSealer(transfer, SERVER)
        self.fds = fds or {}  # path -> fd
        self.digests = digests_for(list(files))

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


class TierAnswers:
    """The server thread's answers on one node's tier. `lock` guards the store (the hold threads use it too);
    `transfers` is the server thread's alone."""

    def __init__(self, store: TierStore, lock: threading.Lock, transfers: Transfers, data_address: str) -> None:
        self.store = store
        self._lock = lock
        self.transfers = transfers
        self.data_address = data_address

    def let_go(self, transfer: OpenTransfer | None) -> None:
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
        run, checkpoint_dir, rank = (getattr(msg, a, d) for a, d in (("run", ""), ("checkpoint_dir", ""), ("rank", -1)))
        if isinstance(msg, (m.TierChunk, m.TierFetch)) and msg.session:
            self.let_go(self.transfers.end(msg.session))
        elif isinstance(msg, (m.TierOffer, m.TierOfferEnd)):
            key = CopyKey(run, checkpoint_dir, rank)
            self.let_go(self.transfers.end(self.transfers.offer_of(ident, key)))
            with self._lock:
                if isinstance(msg, m.TierOffer) and self.store.writing(key) and not self.transfers.receiving(key):
                    self.store.abort(key)  # begun by this offer, which failed before its transfer opened
        log.warning("a %s of %s rank %s failed: %s", type(msg).__name__, checkpoint_dir or "-", rank, why)
        return m.TierStored(run=run, checkpoint_dir=checkpoint_dir, rank=rank, node_id=node, ok=False, reason=why)

    def data(self, msg: m.TierRequest, head: bytes, sealed: memoryview | bytes, now: float,
             ) -> m.TierReply | list | None:
        """A chunk of an offer, or a fetch of one, on the data socket: only within a transfer this server opened."""
        if not isinstance(msg, (m.TierChunk, m.TierFetch)):
            return None  # nothing else is asked here, and the data socket answers no stranger more than it must
        ids = dict(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=msg.rank)
        node = self.store.node_id
        transfer = self.transfers.touch(msg.session, CopyKey(msg.run, msg.checkpoint_dir, msg.rank), now)
        if isinstance(transfer, str):
            return m.TierStored(**ids, node_id=node, ok=False, reason=transfer)
        if isinstance(msg, m.TierChunk) and transfer.is_offer:
            if msg.path not in transfer.sizes:
                return m.TierStored(**ids, node_id=node, ok=False, reason=f"no offer of {msg.path} is open")
            try:
                data = transfer.carrier.sealer.open(head, msg, sealed)
            except TransferError as e:
                return m.TierStored(**ids, node_id=node, ok=False, reason=str(e))
            why = transfer.past_declared(msg.path, msg.offset, len(data))
            if why is not None:
                self.let_go(self.transfers.end(msg.session))
                return m.TierStored(**ids, node_id=node, ok=False, reason=why)
            write_all(transfer.carrier.fds[msg.path], data, msg.offset)
            transfer.carrier.digests.update(msg.path, msg.offset, data)
            return m.TierAck(**ids, path=msg.path, offset=msg.offset)
        if isinstance(msg, m.TierFetch) and not transfer.is_offer and msg.path:
            reply = self._fetch(transfer.key, msg)
            if isinstance(reply, tuple):
                return transfer.carrier.sealer.seal(*reply)
            return reply
        return m.TierStored(**ids, node_id=node, ok=False,
                            reason=f"a {type(msg).__name__} does not belong on the data socket")

    def request(self, ident: bytes, msg: m.TierRequest, now: float) -> m.TierReply:
        """A request on the CURVE socket, other than the hold threads' (holds, pulls, uploads)."""
        node = self.store.node_id
        if isinstance(msg, m.TierList):
            with self._lock:
                copies = [m.TierCopyInfo(run=r.run, checkpoint_dir=r.checkpoint_dir, rank=r.rank, seq=r.seq,
                                         nbytes=r.nbytes, primary=r.primary, committed=r.committed)
                          for r in self.store.records()]
                return m.TierHoldings(node_id=node, budget_bytes=self.store.book.budget_bytes,
                                      used_bytes=self.store.book.used(), copies=copies)
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
        ids = dict(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=msg.rank)
        if isinstance(msg, m.TierOffer):
            return self._offer(ident, key, msg, now)
        if isinstance(msg, m.TierOfferEnd):
            transfer = self.transfers.finish_offer(ident, key)
            if isinstance(transfer, str):
                return m.TierStored(**ids, node_id=node, ok=False, reason=transfer)
            transfer.carrier.close()
            with self._lock:
                # The checksums of what came in order were computed as it was written: nothing is read again.
                why = self.store.finish(key, transfer.carrier.digests.digests())
            return m.TierStored(**ids, node_id=node, ok=why is None, reason=why or "")
        if isinstance(msg, m.TierFetch) and not msg.path:
            offer = self._fetch(key, msg)
            if isinstance(offer, m.TierOffer):
                transfer = new_transfer(self.data_address)
                self.transfers.open(transfer.session, key, now, carrier=_Carrier(transfer))
                return msgspec.structs.replace(offer, transfer=transfer)
            return offer
        return m.TierStored(**ids, node_id=node, ok=False,
                            reason=f"a {type(msg).__name__} goes to the data socket of the transfer it belongs to")

    def _offer(self, ident: bytes, key: CopyKey, msg: m.TierOffer, now: float) -> m.TierReply:
        ids = dict(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=msg.rank)
        with self._lock:
            admission, partial = self.store.begin(msg.run, msg.checkpoint_dir, msg.rank, msg.seq, msg.files,
                                                  msg.primary)
        if partial is None:
            return m.TierStored(**ids, node_id=self.store.node_id, ok=False,
                                reason=admission.reason if not admission.admit else "already held")
        fds = {}
        try:
            for entry in msg.files:
                if entry.path in fds:
                    raise ValueError(f"file {entry.path} is offered twice")
                fds[entry.path] = safepath.open_under(partial, entry.path, write=True)
        except (OSError, ValueError):
            for fd in fds.values():
                os.close(fd)
            with self._lock:
                self.store.abort(key)
            raise  # answered by `failed`, with the path and errno, once what was half-made is gone
        transfer = new_transfer(self.data_address)
        self.transfers.open(transfer.session, key, now, sender=ident, sizes={f.path: f.size for f in msg.files},
                            carrier=_Carrier(transfer, fds, msg.files))
        return m.TierAck(**ids, transfer=transfer)

    def _fetch(self, key: CopyKey, msg: m.TierFetch) -> m.TierReply | tuple[m.TierChunk, memoryview]:
        ids = dict(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=msg.rank)
        with self._lock:
            record, where = self.store.record(key), self.store.path(key)
        if record is None or where is None:
            return m.TierStored(**ids, node_id=self.store.node_id, ok=False,
                                reason=f"{msg.checkpoint_dir} rank {msg.rank} is not held on {self.store.node_id}")
        if not msg.path:
            return m.TierOffer(**ids, seq=record.seq, files=record.files, primary=record.primary)
        if not any(f.path == msg.path for f in record.files):  # the copy's own files, nothing else under it
            return m.TierStored(**ids, node_id=self.store.node_id, ok=False,
                                reason=f"{msg.path} is not a file of {msg.checkpoint_dir} rank {msg.rank}")
        try:
            view = file_view(where, msg.path)
        except (OSError, ValueError) as e:
            return m.TierStored(**ids, node_id=self.store.node_id, ok=False, reason=f"cannot read {msg.path}: {e}")
        return m.TierChunk(**ids, path=msg.path, offset=msg.offset), view[msg.offset:msg.offset + msg.length]
