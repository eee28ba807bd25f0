"""A node's tier server: keeps checkpoint copies in memory and trades them with peers.

Four threads of the agent's process, none of them its poll loop, which never waits on
a copy. The server thread owns a ROUTER socket (CURVE, the cluster key: the same
authenticator as the agent's) and a plain one for the bytes of copies, sealed under a key
each transfer gets over the first (`tier_client.Sealer`), and answers what takes a chunk's time
at most: a peer's offer and chunks of a replica, fetches of a chunk, commits, frees, the list. The hold threads do
what takes a copy's time: a `TierHold` copies a rank's files in, then pushes the replica to
the peer named in it, and its answer (`TierStored`, with both nodes and the seconds each
took) goes back through the server thread once the replica is there or has failed. What a
commit or a restore waits for (a hold that copies a rank's files in, with the replica of a
checkpoint committed in memory, such as a drain's; a pull) has a thread of its own, so that it
never waits behind a replica made beside a durable commit; so has a `TierUpload` (a held copy,
checked, uploaded to the run's storage: a drain's checkpoint committed in memory), which takes
storage's time. While the node drains, replicas beside durable commits wait until the
checkpoint saved for the drain is held (or the deadline), as they share the node's cores and
memory bandwidth with its save and its copy (seen: a 2 GB replica of the checkpoint before
still going while a drain's checkpoint was saved).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import threading
import time
from pathlib import Path

import msgspec
import zmq

from outlast.agent.tier_client import (CHUNK, SERVER, Sealer, TransferError, digests_for, fetch, file_view,
                                       new_transfer, push, write_all)
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.protocol.transport import TIER_REQUESTS, BadMessage, bind_router, connect_dealer, encode
from outlast.storage import open_storage
from outlast.storage.memtier import CopyKey
from outlast.storage.tier_store import TierStore, check_files, default_root
from outlast.storage.retry import upload_with_retries

log = logging.getLogger("outlast.agent.tier")

DRAIN_HOLD_S = 120.0  # a drain without a deadline holds replicas beside durable commits back this long at most
SESSION_IDLE_S = 600.0  # a transfer unused this long is forgotten (its asker died): tier_client's timeouts are far shorter


class _Session:
    """A transfer open on this server: an offer being received (its files open for writing), or a fetch."""

    def __init__(self, transfer: m.Transfer, key: CopyKey, fds: dict[str, int] | None, now: float,
                 files: list[m.FileEntry] = ()) -> None:
        self.sealer = Sealer(transfer, SERVER)
        self.key = key
        self.fds = fds  # path -> fd for an offer; None for a fetch
        self.digests = digests_for(list(files))  # an offer's, as its chunks are written
        self.sizes = {f.path: f.size for f in files}  # an offer's: no chunk is written past its file's end
        self.used = now

    def close(self) -> None:
        for fd in (self.fds or {}).values():
            os.close(fd)
        self.fds = {}


def queue_for(msg: m.TierHold | m.TierPull | m.TierUpload) -> str:
    """The thread a request waits for: "upload" (storage's time), "waited" (what a commit or a restore waits
    for: a hold with files to copy in, a pull) or "hold" (a replica of a copy held already, beside a durable
    commit)."""
    if isinstance(msg, m.TierUpload):
        return "upload"
    return "waited" if isinstance(msg, m.TierPull) or msg.source_dir else "hold"


class TierServer:
    def __init__(self, ctx: zmq.Context, key: ClusterKey | None, store: TierStore, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self._ctx = ctx
        self._key = key
        self.store = store
        self._lock = threading.Lock()  # the store: both threads use it
        self._sock, self.address = bind_router(ctx, host, port, key)
        # Sealed bytes only (see the module); a socket without the cluster key takes no frame larger than a sealed
        # chunk from anyone.
        self._data, self.data_address = bind_router(ctx, host, 0, None, max_frame=CHUNK + (64 << 10))
        self._sessions: dict[bytes, _Session] = {}
        self._replies = f"inproc://outlast-tier-{id(self)}"
        self._holds: queue.Queue[tuple[bytes, m.TierHold | m.TierPull, float] | None] = queue.Queue()
        # What a commit or a restore waits for never queues behind a replica made beside a durable commit (seen:
        # a drain's 2 GB checkpoint missed its 10 s deadline behind the replica of the checkpoint before it).
        self._waiting: queue.Queue[tuple[bytes, m.TierHold | m.TierPull, float] | None] = queue.Queue()
        # Uploads to storage take storage's time: a thread of their own, so that no pull or replica waits on one.
        self._uploads: queue.Queue[tuple[bytes, m.TierUpload, float] | None] = queue.Queue()
        self._writing: dict[tuple[bytes, CopyKey], bytes] = {}  # offers being received: their sessions
        self._stop = threading.Event()
        # While the node drains, replicas beside durable commits wait (`_background_turn`) until this time, or
        # until what the drain's commit waits for has been held; None: they go.
        self._drain_hold_until: float | None = None
        self._waited_busy = 0  # requests in the "waited" queue or being carried out
        self._waited_done = False  # one of them ended since the drain began
        self._turn = threading.Condition()
        self._inbox = ctx.socket(zmq.PULL)
        self._inbox.bind(self._replies)
        self._threads = [threading.Thread(target=self._serve, name="outlast-tier", daemon=True),
                         threading.Thread(target=self._hold_loop, args=(self._holds,), name="outlast-tier-hold",
                                         daemon=True),
                         threading.Thread(target=self._hold_loop, args=(self._waiting,), name="outlast-tier-waited",
                                         daemon=True),
                         threading.Thread(target=self._hold_loop, args=(self._uploads,), name="outlast-tier-upload",
                                         daemon=True)]

    def drain(self, deadline_unix_s: float | None) -> None:
        """The node drains: its cores and its bandwidth go to the checkpoint saved for the drain. Replicas beside
        durable commits (in storage already) wait until that checkpoint is held here and on its peer (what the
        drain's commit waits for), or until the deadline (`DRAIN_HOLD_S` without one)."""
        with self._turn:
            self._drain_hold_until = deadline_unix_s if deadline_unix_s is not None else time.time() + DRAIN_HOLD_S
            self._waited_done = False
            self._turn.notify_all()

    def _background_turn(self) -> None:
        with self._turn:
            while not self._stop.is_set() and self._drain_hold_until is not None:
                left = self._drain_hold_until - time.time()
                if left <= 0 or (self._waited_done and not self._waited_busy):
                    self._drain_hold_until = None
                    break
                self._turn.wait(min(left, 1.0))

    def _waited(self, delta: int) -> None:
        with self._turn:
            self._waited_busy += delta
            if delta < 0:
                self._waited_done = True
            self._turn.notify_all()

    def start(self) -> "TierServer":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for todo in (self._holds, self._waiting, self._uploads):
            todo.put(None)
        for t in self._threads:
            t.join(timeout=10)

    # -- the server thread ------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in (self._sock, self._data, self._inbox):
            poller.register(sock, zmq.POLLIN)
        swept = time.monotonic()
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(200):
                    if sock is self._inbox:
                        ident, data = self._inbox.recv_multipart()
                        self._sock.send_multipart([ident, data])
                        continue
                    frames = sock.recv_multipart(copy=False)
                    if len(frames) < 2:
                        continue
                    ident, head = frames[0].bytes, frames[1].bytes
                    try:
                        msg = TIER_REQUESTS.decode(head)
                    except BadMessage as e:
                        log.warning("dropped a malformed tier request: %s", e)
                        continue
                    if sock is self._data:
                        # A chunk's sealed bytes are the frame after its header (tier_client.Sealer.seal).
                        reply = self._handle_data(msg, head, frames[2].buffer if len(frames) > 2 else b"")
                    else:
                        reply = self._handle(ident, msg)
                    if isinstance(reply, list):
                        sock.send_multipart([ident, *reply], copy=False)
                    elif reply is not None:
                        sock.send_multipart([ident, encode(reply)])
                if time.monotonic() - swept > 10:
                    swept = time.monotonic()
                    self._forget_idle(swept)
        finally:
            for session in self._sessions.values():
                session.close()
            self._sock.close(linger=0)
            self._data.close(linger=0)
            self._inbox.close(linger=0)

    def _forget_idle(self, now: float) -> None:
        for sid in [sid for sid, sess in self._sessions.items() if now - sess.used > SESSION_IDLE_S]:
            self._sessions.pop(sid).close()
        live = set(self._sessions)
        for writing in [w for w, sid in self._writing.items() if sid not in live]:
            del self._writing[writing]

    def _open(self, key: CopyKey, fds: dict[str, int] | None, files: list[m.FileEntry] = ()) -> m.Transfer:
        transfer = new_transfer(self.data_address)
        self._sessions[transfer.session] = _Session(transfer, key, fds, time.monotonic(), files)
        return transfer

    def _handle_data(self, msg: m.TierRequest, head: bytes, sealed: memoryview | bytes,
                     ) -> m.TierReply | list | None:
        """A chunk of an offer, or a fetch of one, on the data socket: only within a transfer this server opened."""
        if not isinstance(msg, (m.TierChunk, m.TierFetch)):
            return None  # nothing else is asked here, and the data socket answers no stranger more than it must
        ids = dict(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=msg.rank)
        session = self._sessions.get(msg.session)
        if session is None or session.key != CopyKey(msg.run, msg.checkpoint_dir, msg.rank):
            return m.TierStored(**ids, node_id=self.store.node_id, ok=False,
                                reason=f"no transfer of {msg.checkpoint_dir} rank {msg.rank} is open on "
                                       f"{self.store.node_id}")
        session.used = time.monotonic()
        if isinstance(msg, m.TierChunk) and session.fds is not None:
            if msg.path not in session.fds:
                return m.TierStored(**ids, node_id=self.store.node_id, ok=False,
                                    reason=f"no offer of {msg.path} is open")
            try:
                data = session.sealer.open(head, msg, sealed)
            except TransferError as e:
                return m.TierStored(**ids, node_id=self.store.node_id, ok=False, reason=str(e))
            size = session.sizes.get(msg.path, 0)
            if msg.offset < 0 or msg.offset + len(data) > size:
                return m.TierStored(**ids, node_id=self.store.node_id, ok=False,
                                    reason=f"a chunk of {msg.path} at offset {msg.offset} ({len(data)} bytes) is outside "
                                           f"the {size} bytes its offer named")
            write_all(session.fds[msg.path], data, msg.offset)
            session.digests.update(msg.path, msg.offset, data)
            return m.TierAck(**ids, path=msg.path, offset=msg.offset)
        if isinstance(msg, m.TierFetch) and session.fds is None and msg.path:
            reply = self._fetch(session.key, msg)
            if isinstance(reply, tuple):
                return session.sealer.seal(*reply)
            return reply
        return m.TierStored(**ids, node_id=self.store.node_id, ok=False,
                            reason=f"a {type(msg).__name__} does not belong on the data socket")

    def _handle(self, ident: bytes, msg: m.TierRequest) -> m.TierReply | None:
        node = self.store.node_id
        if isinstance(msg, (m.TierHold, m.TierPull, m.TierUpload)):
            which = queue_for(msg)
            if which == "waited":
                self._waited(+1)
            {"upload": self._uploads, "waited": self._waiting, "hold": self._holds}[which].put(
                (ident, msg, time.monotonic()))
            return None
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
            with self._lock:
                self.store.free_run(msg.run)
            return m.TierAck(run=msg.run, checkpoint_dir="", rank=-1)
        key = CopyKey(msg.run, msg.checkpoint_dir, msg.rank)
        ids = dict(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=msg.rank)
        if isinstance(msg, m.TierOffer):
            with self._lock:
                admission, partial = self.store.begin(msg.run, msg.checkpoint_dir, msg.rank, msg.seq, msg.files,
                                                      msg.primary)
            if partial is None:
                return m.TierStored(**ids, node_id=node, ok=False,
                                    reason=admission.reason if not admission.admit else "already held")
            fds = {}
            for entry in msg.files:
                path = partial / entry.path
                path.parent.mkdir(parents=True, exist_ok=True)
                fds[entry.path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            transfer = self._open(key, fds, msg.files)
            self._writing[(ident, key)] = transfer.session
            return m.TierAck(**ids, transfer=transfer)
        if isinstance(msg, m.TierOfferEnd):
            session = self._sessions.pop(self._writing.pop((ident, key), b""), None)
            if session is not None:
                session.close()
            with self._lock:
                # The checksums of what came in order were computed as it was written: nothing is read again.
                why = self.store.finish(key, session.digests.digests() if session is not None else None)
            return m.TierStored(**ids, node_id=node, ok=why is None, reason=why or "")
        if isinstance(msg, m.TierFetch) and not msg.path:
            offer = self._fetch(key, msg)
            if isinstance(offer, m.TierOffer):
                return msgspec.structs.replace(offer, transfer=self._open(key, None))
            return offer
        return m.TierStored(**ids, node_id=node, ok=False,
                            reason=f"a {type(msg).__name__} goes to the data socket of the transfer it belongs to")

    def _fetch(self, key: CopyKey, msg: m.TierFetch) -> m.TierReply | tuple[m.TierChunk, memoryview]:
        ids = dict(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=msg.rank)
        with self._lock:
            record, where = self.store.record(key), self.store.path(key)
        if record is None or where is None:
            return m.TierStored(**ids, node_id=self.store.node_id, ok=False,
                                reason=f"{msg.checkpoint_dir} rank {msg.rank} is not held on {self.store.node_id}")
        if not msg.path:
            return m.TierOffer(**ids, seq=record.seq, files=record.files, primary=record.primary)
        try:
            view = file_view(where / msg.path)
        except (OSError, ValueError) as e:
            return m.TierStored(**ids, node_id=self.store.node_id, ok=False, reason=f"cannot read {msg.path}: {e}")
        return m.TierChunk(**ids, path=msg.path, offset=msg.offset), view[msg.offset:msg.offset + msg.length]

    # -- the hold thread ----------------------------------------------------------------------

    def _hold_loop(self, todo: queue.Queue) -> None:
        out = self._ctx.socket(zmq.PUSH)
        out.connect(self._replies)
        peers: dict[str, zmq.Socket] = {}
        try:
            while (item := todo.get()) is not None:
                ident, hold, asked_at = item
                try:
                    reply = self._pull(hold, asked_at) if isinstance(hold, m.TierPull) else \
                        self._upload(hold, asked_at) if isinstance(hold, m.TierUpload) else \
                        self._hold(hold, asked_at, peers)
                except Exception as e:  # a bug here must not leave every later hold unanswered
                    log.exception("the memory tier failed on %s", type(hold).__name__)
                    reply = m.TierStored(run=hold.run, checkpoint_dir=hold.checkpoint_dir, rank=hold.rank,
                                         node_id=self.store.node_id, ok=False,
                                         reason=f"the tier server failed: {type(e).__name__}: {e}")
                out.send_multipart([ident, encode(reply)])
                if todo is self._waiting:
                    self._waited(-1)
        finally:
            for sock in peers.values():
                sock.close(linger=0)
            out.close(linger=0)

    def _hold(self, hold: m.TierHold, asked_at: float, peers: dict[str, zmq.Socket]) -> m.TierStored:
        node = self.store.node_id
        ids = dict(run=hold.run, checkpoint_dir=hold.checkpoint_dir, rank=hold.rank)
        nbytes = sum(f.size for f in hold.files)
        key = CopyKey(hold.run, hold.checkpoint_dir, hold.rank)
        with self._lock:
            held = self.store.record(key) is not None
        replica: tuple[str, str, float] | None = None
        if not held and hold.peer_address:
            # A commit waits for both copies (a drain's checkpoint, a run kept in memory): the replica goes from
            # the rank's own files while they are copied in, not after.
            copied: list[str | None] = []
            copying = threading.Thread(target=lambda: copied.append(self._copy_in(hold)), name="outlast-tier-copy-in",
                                       daemon=True)
            copying.start()
            replica = self._push(hold, key, Path(hold.source_dir), peers)
            copying.join()
            why = copied[0] if copied else f"{hold.checkpoint_dir} rank {hold.rank} was not kept in memory: the copy failed"
        elif not held:
            why = self._copy_in(hold)
        else:
            why = None
        if why is not None:
            replica_node, replica_reason, replica_s = replica or ("", "", 0.0)
            return m.TierStored(**ids, node_id=node, ok=False, reason=why, nbytes=nbytes, replica_node=replica_node,
                                replica_reason=replica_reason, seconds=time.monotonic() - asked_at,
                                replica_seconds=replica_s)
        with self._lock:
            src = self.store.path(key)
        if replica is None and hold.peer_address and src is not None:
            replica = self._push(hold, key, src, peers)
        replica_node, replica_reason, replica_s = replica or ("", "", 0.0)
        return m.TierStored(**ids, node_id=node, ok=src is not None, nbytes=nbytes,
                            reason="" if src is not None else "evicted before its replica was made",
                            replica_node=replica_node, replica_reason=replica_reason,
                            seconds=time.monotonic() - asked_at, replica_seconds=replica_s)

    def _push(self, hold: m.TierHold, key: CopyKey, src: Path, peers: dict[str, zmq.Socket]) -> tuple[str, str, float]:
        """The replica of the files under `src` on the hold's peer: (the node that keeps it, or "" and why not; seconds)."""
        started = time.monotonic()
        sock = peers.get(hold.peer_address)
        if sock is None:
            sock = peers[hold.peer_address] = connect_dealer(self._ctx, hold.peer_address, key=self._key)
        try:
            turn = self._background_turn if queue_for(hold) == "hold" else None
            stored = push(sock, key, hold.seq, hold.files, src, hold.peer_address, turn=turn)
            if stored.ok:
                return stored.node_id, "", time.monotonic() - started
            return "", f"{stored.node_id} did not keep the replica: {stored.reason}", time.monotonic() - started
        except (TransferError, OSError) as e:
            peers.pop(hold.peer_address).close(linger=0)  # its answers may still come: a fresh socket
            return "", f"the replica to {hold.peer_address} failed: {e}", time.monotonic() - started

    def _pull(self, pull: m.TierPull, asked_at: float) -> m.TierStored:
        node = self.store.node_id
        ids = dict(run=pull.run, checkpoint_dir=pull.checkpoint_dir, rank=pull.rank)
        key = CopyKey(pull.run, pull.checkpoint_dir, pull.rank)
        with self._lock:
            record, where = self.store.record(key), self.store.path(key)
        skipped = ""
        if record is not None and where is not None:
            # Checked before it is trusted (off the lock: the server thread serves chunks meanwhile): a copy
            # that differs from its record is dropped, and the peer's is fetched in its place.
            why = check_files(where, record.files)
            if why is None:
                return m.TierStored(**ids, node_id=node, ok=True, reason="already held", nbytes=record.nbytes)
            with self._lock:
                self.store.drop(key)
            skipped = f"the copy of rank {pull.rank} in memory on {node} was skipped: {why}"
            log.warning("%s; fetching it from %s", skipped, pull.from_address)

        def room(offer: m.TierOffer) -> Path:
            with self._lock:
                admission, partial = self.store.begin(pull.run, pull.checkpoint_dir, pull.rank, offer.seq,
                                                      offer.files, primary=False)
            if partial is None:
                raise TransferError(admission.reason if not admission.admit else "already held")
            return partial

        try:
            offer, digests = fetch(self._ctx, self._key, pull.from_address, key, None, dest_for=room)
        except (TransferError, OSError) as e:
            with self._lock:
                self.store.abort(key)
            return m.TierStored(**ids, node_id=node, ok=False, reason=f"fetching from {pull.from_address}: {e}",
                                seconds=time.monotonic() - asked_at, skipped=skipped)
        with self._lock:
            why = self.store.finish(key, digests)
        return m.TierStored(**ids, node_id=node, ok=why is None, reason=why or "", skipped=skipped,
                            nbytes=sum(f.size for f in offer.files), seconds=time.monotonic() - asked_at)

    def _upload(self, up: m.TierUpload, asked_at: float) -> m.TierStored:
        """The held copy, checked against its record, uploaded to the run's storage."""
        node = self.store.node_id
        ids = dict(run=up.run, checkpoint_dir=up.checkpoint_dir, rank=up.rank)
        key = CopyKey(up.run, up.checkpoint_dir, up.rank)
        with self._lock:
            record, where = self.store.record(key), self.store.path(key)
        if record is None or where is None:
            return m.TierStored(**ids, node_id=node, ok=False, reason=f"{up.checkpoint_dir} rank {up.rank} is not "
                                f"held on {node}")
        why = check_files(where, record.files)
        if why is not None:
            with self._lock:
                self.store.drop(key)
            return m.TierStored(**ids, node_id=node, ok=False, reason=f"the copy of rank {up.rank} in memory on "
                                f"{node} was not uploaded: {why}", seconds=time.monotonic() - asked_at)
        try:
            upload_with_retries(open_storage(up.run), str(where), up.checkpoint_dir, replace=up.replace)
        except Exception as e:  # noqa: BLE001 - any failure of storage's is the answer, not the thread's end
            return m.TierStored(**ids, node_id=node, ok=False, reason=f"uploading from {node}'s memory to "
                                f"{up.run}/{up.checkpoint_dir} failed: {type(e).__name__}: {e}",
                                seconds=time.monotonic() - asked_at)
        return m.TierStored(**ids, node_id=node, ok=True, nbytes=record.nbytes, seconds=time.monotonic() - asked_at)

    def _copy_in(self, hold: m.TierHold) -> str | None:
        with self._lock:
            admission, partial = self.store.begin(hold.run, hold.checkpoint_dir, hold.rank, hold.seq, hold.files)
        if partial is None:
            return None if admission.admit else admission.reason
        key = CopyKey(hold.run, hold.checkpoint_dir, hold.rank)
        linked: dict[str, str] = {}
        try:
            for entry in hold.files:
                source, target = Path(hold.source_dir) / entry.path, partial / entry.path
                target.parent.mkdir(parents=True, exist_ok=True)
                if hold.link and _linked(source, target):
                    # The rank's own file, whose checksum it has just taken; every later use checks it again.
                    linked[entry.path] = entry.checksum[1]
                else:
                    shutil.copyfile(source, target)
        except (OSError, ValueError) as e:
            with self._lock:
                self.store.abort(key)
            return f"{hold.checkpoint_dir} rank {hold.rank} was not kept in memory: {e}"
        with self._lock:
            return self.store.finish(key, linked)



def start_tier(ctx: zmq.Context, key: ClusterKey | None, node_id: str, host: str, budget_bytes: int,
               root: Path | None = None, fitted: bool = False) -> TierServer | None:
    """The node's tier, its copies reclaimed from an earlier agent of the node; None with no budget.

    `fitted`: the budget is outlast's default, not the user's, so it shrinks to half of a small tmpfs
    (a container's /dev/shm is 64 MiB by default) instead of refusing the node."""
    if budget_bytes <= 0:
        return None
    root = root or default_root()
    room = shutil.disk_usage(_existing(root)).total
    if fitted and budget_bytes > room // 2:
        log.info("the memory tier's default budget (%.2f GiB) is lowered to half of the %.2f GiB file system "
                 "behind %s; give --checkpoint-memory or OUTLAST_TIER_DIR for more", budget_bytes / 2**30,
                 room / 2**30, root)
        budget_bytes = room // 2
    if budget_bytes > room:
        raise ValueError(f"--checkpoint-memory {budget_bytes / 2**30:.2f} GiB is more than the whole of the file "
                         f"system behind {root} ({room / 2**30:.2f} GiB); lower it, or set OUTLAST_TIER_DIR to a "
                         "larger tmpfs")
    store = TierStore(root, node_id, budget_bytes)
    for line in store.open():
        log.info("%s", line)
    server = TierServer(ctx, key, store, host).start()
    log.info("keeping checkpoint copies in memory: up to %.2f GiB in %s, served at %s", budget_bytes / 2**30,
             store.home, server.address)
    return server


def _linked(source: Path, target: Path) -> bool:
    """A hard link of `source` at `target`; False where the two are on different file systems or the kernel
    refuses it (a file of another user, with protected hard links), and the file is copied instead."""
    try:
        os.link(source, target)
        return True
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP):
            return False
        raise


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path
