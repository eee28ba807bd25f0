"""The memory tier's work that takes a copy's time, carried out on the tier server's hold threads.

A `TierHold` copies a rank's files into the node's tier and pushes the replica to the peer named in
it; a `TierPull` fetches a copy from a peer; a `TierUpload` checks a held copy and uploads it to the
run's storage. Each returns its answer, a `TierStored` with the nodes and the seconds each took:
an error in one (a full tmpfs: ENOSPC) is its answer, saying the node, the path and the errno, and
what it had half-written goes, with its bytes in the budget. Which thread a request waits on, and
when a replica may go while the node drains, are the schedule's (`tier_schedule.py`).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from outlast.agent.tier_client import TransferError, copy_checked, fetch, push, refused
from outlast.agent.tier_schedule import queue_for
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.protocol.transport import connect_dealer
from outlast.storage import open_storage, safepath
from outlast.storage.memtier import CopyKey
from outlast.storage.retry import upload_with_retries
from outlast.storage.tier_store import TierRecord, TierStore, check_files, os_failure

log = logging.getLogger("outlast.agent.tier")


class TierWork:
    """The hold threads' jobs on one node's tier. `lock` guards the store (the server thread uses it too);
    `turn`, called before each chunk of a replica beside a durable commit, returns when it may go on.
    `source_owner`: the uid whose files a rank's hold may name (--worker-user's)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], key: ClusterKey | None, store: TierStore, lock: threading.Lock,
                 turn: Callable[[], None], source_owner: int | None = None) -> None:
        self._ctx = ctx
        self._key = key
        self.store = store
        self._lock = lock
        self._turn = turn
        self._source_owner = source_owner

    def answer(self, msg: m.TierHold | m.TierPull | m.TierUpload, asked_at: float,
               peers: dict[str, zmq.Socket[bytes]]) -> m.TierStored:
        """The request carried out, its answer; an error its answer too. `peers`: the calling thread's sockets to
        peers, by address (a ZeroMQ socket belongs to one thread)."""
        try:
            if isinstance(msg, m.TierPull):
                return self.pull(msg, asked_at)
            if isinstance(msg, m.TierUpload):
                return self.upload(msg, asked_at)
            return self.hold(msg, asked_at, peers)
        except Exception as e:  # a bug here must not leave every later hold unanswered
            if not isinstance(e, OSError):
                log.exception("the memory tier failed on %s", type(msg).__name__)
            return m.TierStored(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=msg.rank,
                                node_id=self.store.node_id, ok=False,
                                reason=os_failure(self.store.node_id, self.store.root, e)
                                if isinstance(e, OSError) else f"the tier server failed: {type(e).__name__}: {e}")

    def hold(self, hold: m.TierHold, asked_at: float, peers: dict[str, zmq.Socket[bytes]]) -> m.TierStored:
        node = self.store.node_id
        nbytes = sum(f.size for f in hold.files)
        key = CopyKey(hold.run, hold.checkpoint_dir, hold.rank)
        with self._lock:
            held = self.store.record(key) is not None
        replica: tuple[str, str, float] | None = None
        if not held and hold.peer_address:
            # A commit waits for both copies (a drain's checkpoint, a run kept in memory): the replica goes from
            # the rank's own files while they are copied in, not after.
            copied: list[str | None] = []
            copying = threading.Thread(target=lambda: copied.append(self.copy_in(hold)), name="outlast-tier-copy-in",
                                       daemon=True)
            copying.start()
            replica = self.replicate(hold, key, Path(hold.source_dir), peers, owner=self._source_owner)
            copying.join()
            why = copied[0] if copied else f"{hold.checkpoint_dir} rank {hold.rank} was not kept in memory: the copy failed"
        elif not held:
            why = self.copy_in(hold)
        else:
            why = None
        if why is not None:
            replica_node, replica_reason, replica_s = replica or ("", "", 0.0)
            return m.TierStored(run=hold.run, checkpoint_dir=hold.checkpoint_dir, rank=hold.rank, node_id=node,
                                ok=False, reason=why, nbytes=nbytes, replica_node=replica_node,
                                replica_reason=replica_reason, seconds=time.monotonic() - asked_at,
                                replica_seconds=replica_s)
        with self._lock:
            src = self.store.path(key)
            if src is not None:
                self.store.reading(key, 1)  # read off the lock: its pages are not reused meanwhile
        try:
            if replica is None and hold.peer_address and src is not None:
                replica = self.replicate(hold, key, src, peers)
        finally:
            if src is not None:
                with self._lock:
                    self.store.reading(key, -1)
        replica_node, replica_reason, replica_s = replica or ("", "", 0.0)
        return m.TierStored(run=hold.run, checkpoint_dir=hold.checkpoint_dir, rank=hold.rank, node_id=node,
                            ok=src is not None, nbytes=nbytes,
                            reason="" if src is not None else "evicted before its replica was made",
                            replica_node=replica_node, replica_reason=replica_reason,
                            seconds=time.monotonic() - asked_at, replica_seconds=replica_s)

    def replicate(self, hold: m.TierHold, key: CopyKey, src: Path, peers: dict[str, zmq.Socket[bytes]],
                  owner: int | None = None) -> tuple[str, str, float]:
        """The replica of the files under `src` on the hold's peer: (the node that keeps it, or "" and why not; seconds)."""
        started = time.monotonic()
        sock = peers.get(hold.peer_address)
        if sock is None:
            sock = peers[hold.peer_address] = connect_dealer(self._ctx, hold.peer_address, key=self._key)
        try:
            turn = self._turn if queue_for(hold) == "hold" else None
            stored = push(sock, key, hold.seq, hold.files, src, hold.peer_address, turn=turn, owner=owner)
            if stored.ok:
                return stored.node_id, "", time.monotonic() - started
            return "", f"{stored.node_id} did not keep the replica: {stored.reason}", time.monotonic() - started
        except (TransferError, OSError) as e:
            peers.pop(hold.peer_address).close(linger=0)  # its answers may still come: a fresh socket
            return "", f"the replica to {hold.peer_address} failed: {e}", time.monotonic() - started

    def pull(self, pull: m.TierPull, asked_at: float) -> m.TierStored:
        node = self.store.node_id
        key = CopyKey(pull.run, pull.checkpoint_dir, pull.rank)
        with self._lock:
            record, where = self.store.record(key), self.store.path(key)
        skipped = ""
        if record is not None and where is not None:
            # Checked before it is trusted (off the lock: the server thread serves chunks meanwhile): a copy
            # that differs from its record is dropped, and the peer's is fetched in its place.
            why = check_files(where, record.files)
            if why is None:
                return m.TierStored(run=pull.run, checkpoint_dir=pull.checkpoint_dir, rank=pull.rank, node_id=node,
                                    ok=True, reason="already held", nbytes=record.nbytes)
            with self._lock:
                self.store.drop(key)
            skipped = f"the copy of rank {pull.rank} in memory on {node} was skipped: {why}"
            log.warning("%s; fetching it from %s", skipped, pull.from_address)

        began: list[Path] = []

        def room(offer: m.TierOffer) -> Path:
            with self._lock:
                admission, partial = self.store.begin(pull.run, pull.checkpoint_dir, pull.rank, offer.seq,
                                                      offer.files, primary=False, reuse=True)
            if partial is None:
                raise TransferError(admission.reason if not admission.admit else "already held")
            began.append(partial)
            return partial

        try:
            offer, digests = fetch(self._ctx, self._key, pull.from_address, key, room)
        except (TransferError, OSError) as e:
            if began:  # else what is being written of this copy is another writer's
                with self._lock:
                    self.store.abort(key)
            why = os_failure(node, self.store.root, e) if isinstance(e, OSError) else str(e)
            return m.TierStored(run=pull.run, checkpoint_dir=pull.checkpoint_dir, rank=pull.rank, node_id=node,
                                ok=False, reason=f"fetching from {pull.from_address}: {why}",
                                seconds=time.monotonic() - asked_at, skipped=skipped)
        with self._lock:
            why = self.store.finish(key, digests)
        if why is None:
            # What a restore pulls is a committed checkpoint, which this node was told before it held a copy:
            # without this, its budget would evict the pulled copy first.
            try:
                with self._lock:
                    self.store.mark_committed(pull.run, pull.checkpoint_dir)
            except OSError as e:  # the record only: the copy is held, protected until the agent restarts
                log.warning("%s", os_failure(node, self.store.root, e))
        return m.TierStored(run=pull.run, checkpoint_dir=pull.checkpoint_dir, rank=pull.rank, node_id=node,
                            ok=why is None, reason=why or "", skipped=skipped,
                            nbytes=sum(f.size for f in offer.files), seconds=time.monotonic() - asked_at)

    def upload(self, up: m.TierUpload, asked_at: float) -> m.TierStored:
        """The held copy, checked against its record, uploaded to the run's storage."""
        node = self.store.node_id
        key = CopyKey(up.run, up.checkpoint_dir, up.rank)
        with self._lock:
            record, where = self.store.record(key), self.store.path(key)
            if record is not None and where is not None:
                self.store.reading(key, 1)  # read off the lock: its pages are not reused meanwhile
        if record is None or where is None:
            return refused(key, node, f"{up.checkpoint_dir} rank {up.rank} is not held on {node}")
        try:
            return self._upload(up, key, record, where, asked_at)
        finally:
            with self._lock:
                self.store.reading(key, -1)

    def _upload(self, up: m.TierUpload, key: CopyKey, record: TierRecord, where: Path,
                asked_at: float) -> m.TierStored:
        node = self.store.node_id
        why = check_files(where, record.files)
        if why is not None:
            with self._lock:
                self.store.drop(key)
            return refused(key, node, f"the copy of rank {up.rank} in memory on {node} was not uploaded: {why}",
                           seconds=time.monotonic() - asked_at)
        try:
            upload_with_retries(open_storage(up.run), str(where), up.checkpoint_dir, replace=up.replace)
        except Exception as e:  # noqa: BLE001 - any failure of storage's is the answer, not the thread's end
            return refused(key, node, f"uploading from {node}'s memory to {up.run}/{up.checkpoint_dir} failed: "
                           f"{type(e).__name__}: {e}", seconds=time.monotonic() - asked_at)
        return m.TierStored(run=up.run, checkpoint_dir=up.checkpoint_dir, rank=up.rank, node_id=node, ok=True,
                            nbytes=record.nbytes, seconds=time.monotonic() - asked_at)

    def copy_in(self, hold: m.TierHold) -> str | None:
        try:
            with self._lock:
                # A draining node links the rank's files in: a rank's file is never written over as spare pages.
                admission, partial = self.store.begin(hold.run, hold.checkpoint_dir, hold.rank, hold.seq, hold.files,
                                                      reuse=not hold.link)
        except OSError as e:  # begin let its room go
            return f"{hold.checkpoint_dir} rank {hold.rank} was not kept in memory: " \
                   f"{os_failure(self.store.node_id, self.store.root, e)}"
        if partial is None:
            return None if admission.admit else admission.reason
        key = CopyKey(hold.run, hold.checkpoint_dir, hold.rank)
        known: dict[str, str] = {}
        try:
            for entry in hold.files:
                if hold.link and _linked(hold.source_dir, entry.path, partial, self._source_owner):
                    # The rank's own file, whose checksum it has just taken; every later use checks it again.
                    known[entry.path] = entry.checksum[1]
                else:
                    # Checked by the checksum of the bytes as they were written: not read again.
                    known[entry.path] = copy_checked(hold.source_dir, entry, partial, self._source_owner)
        except (OSError, ValueError) as e:
            with self._lock:
                self.store.abort(key)
            why = os_failure(self.store.node_id, self.store.root, e) if isinstance(e, OSError) else str(e)
            return f"{hold.checkpoint_dir} rank {hold.rank} was not kept in memory: {why}"
        with self._lock:
            return self.store.finish(key, known)


def _linked(source_dir: str, rel: str, partial: Path, owner: int | None) -> bool:
    """A hard link of `rel` under `source_dir` at the same place under `partial`; False where the two are on
    different file systems or the kernel refuses it (a file of another user, with protected hard links), and
    the file is copied instead."""
    try:
        safepath.link_under(source_dir, rel, partial, owner=owner)
        return True
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP):
            return False
        raise

