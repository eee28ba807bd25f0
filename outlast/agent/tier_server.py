"""A node's tier server: keeps checkpoint copies in memory and trades them with peers.

Four threads of the agent's process, none of them its poll loop, which never waits on
a copy. The server thread owns a ROUTER socket (CURVE, the cluster key: the same
authenticator as the agent's) and a plain one for the bytes of copies, sealed under a key
each transfer gets over the first (`tier_client.TransferSealer`), and answers what takes a chunk's time
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

No request ends a thread: an error in one (a full tmpfs: ENOSPC) is its answer, saying the node,
the path and the errno, and what it had half-written goes, with its bytes in the budget. A copy
being received counts in the budget at its declared size from its offer on, and a transfer whose
sender is silent `transfer_timeout_s` (it died, or closed its socket: ZeroMQ tells the server
neither) is ended the same way. A thread that dies all the same (a bug past those guards) is
started again by `watch`, which the agent's loop calls each turn, and the log says why it died:
the tier's state is the server's, not the thread's, so a new thread goes on where the old one
stopped, and the node keeps its tier (a "memory" run cannot commit without it).
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

from outlast.agent.tier_client import (CHUNK, SERVER, TransferError, TransferSealer, digests_for, fetch, file_view,
                                       new_transfer, push, write_all)
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.protocol.transport import TIER_REQUESTS, BadMessage, bind_router, connect_dealer, encode
from outlast.storage import open_storage, safepath
from outlast.storage.memtier import CopyKey
from outlast.storage.tier_store import TierStore, check_files, default_root, os_failure
from outlast.storage.retry import upload_with_retries

log = logging.getLogger("outlast.agent.tier")

DRAIN_HOLD_S = 120.0  # a drain without a deadline holds replicas beside durable commits back this long at most
# A transfer unused this long is ended (its asker died, or closed its socket), what it wrote with it: twice
# tier_client's 30 s, after which a live asker has given up anyway.
TRANSFER_TIMEOUT_S = float(os.environ.get("OUTLAST_TIER_TRANSFER_TIMEOUT_S", "60"))


class _Session:
    """A transfer open on this server: an offer being received (its files open for writing), or a fetch."""

    def __init__(self, transfer: m.Transfer, key: CopyKey, fds: dict[str, int] | None, now: float,
                 files: list[m.FileEntry] = ()) -> None:
        self.sealer = TransferSealer(transfer, SERVER)
        self.key = key
        self.fds = fds  # path -> fd for an offer; None for a fetch
        self.digests = digests_for(list(files))  # an offer's, as its chunks are written
        self.sizes = {f.path: f.size for f in files}  # an offer's, as declared: no chunk writes past them
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
                 port: int = 0, transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
                 source_owner: int | None = None) -> None:
        self._ctx = ctx
        self._transfer_timeout_s = transfer_timeout_s
        self._key = key
        self.store = store
        # --worker-user: the agent is root, and a rank's files must be its workers' user's (a hold naming another
        # run's copy in this tier, or a file of root's, is refused).
        self._source_owner = source_owner
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
        self._loops = {"outlast-tier": (self._serve, ()), "outlast-tier-hold": (self._hold_loop, (self._holds,)),
                       "outlast-tier-waited": (self._hold_loop, (self._waiting,)),
                       "outlast-tier-upload": (self._hold_loop, (self._uploads,))}
        self._threads = {name: self._thread(name) for name in self._loops}
        self._died: dict[str, str] = {}  # thread name -> why it ended, until `watch` starts it again

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
        for t in self._threads.values():
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for todo in (self._holds, self._waiting, self._uploads):
            todo.put(None)
        for t in self._threads.values():
            t.join(timeout=10)

    def _thread(self, name: str) -> threading.Thread:
        target, args = self._loops[name]

        def run() -> None:
            try:
                target(*args)
            except BaseException as e:  # noqa: BLE001 - said here, and `watch` starts the thread again
                log.exception("the memory tier's thread %s died", name)
                self._died[name] = f"{type(e).__name__}: {e}"

        return threading.Thread(target=run, name=name, daemon=True)

    def watch(self) -> list[str]:
        """Start again each thread that died (what it was doing is lost: its asker times out), saying which and
        why. Called by the agent's loop each turn; returns what was said."""
        said = []
        for name, t in list(self._threads.items()):
            if self._stop.is_set() or t.is_alive() or not t.ident:
                continue
            why = self._died.pop(name, "it returned")
            said.append(f"the memory tier's thread {name} died ({why}); started it again")
            log.error("%s", said[-1])
            self._threads[name] = self._thread(name)
            self._threads[name].start()
        return said

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
                        # A path outside its copy, a field of the wrong type: refused whole, and the asker told.
                        log.warning("refused a malformed tier request: %s", e)
                        sock.send_multipart([ident, encode(m.TierStored(
                            run="", checkpoint_dir="", rank=-1, node_id=self.store.node_id, ok=False,
                            reason=f"{self.store.node_id} refused a request that does not decode: {e}"))])
                        continue
                    try:
                        if sock is self._data:
                            # A chunk's sealed bytes are the frame after its header (tier_client.TransferSealer.seal).
                            reply = self._handle_data(msg, head, frames[2].buffer if len(frames) > 2 else b"")
                        else:
                            reply = self._handle(ident, msg)
                    except Exception as e:  # noqa: BLE001 - the request's answer; the thread goes on
                        reply = self._failed(ident, msg, e)
                    if isinstance(reply, list):
                        sock.send_multipart([ident, *reply], copy=False)
                    elif reply is not None:
                        sock.send_multipart([ident, encode(reply)])
                if time.monotonic() - swept > min(10.0, self._transfer_timeout_s / 4):
                    swept = time.monotonic()
                    self._forget_idle(swept)
        finally:
            if self._stop.is_set():  # else `watch` starts the loop again, on the same sockets and transfers
                for session in self._sessions.values():
                    session.close()
                self._sock.close(linger=0)
                self._data.close(linger=0)
                self._inbox.close(linger=0)

    def _forget_idle(self, now: float) -> None:
        for sid in [sid for sid, sess in self._sessions.items() if now - sess.used > self._transfer_timeout_s]:
            session = self._sessions[sid]
            if session.fds is not None:
                log.warning("a replica of %s rank %d being received on %s has been silent for %.0f s: its sender "
                            "died or gave up; what came of it is dropped", session.key.checkpoint_dir,
                            session.key.rank, self.store.node_id, now - session.used)
            self._end(sid)

    def _end(self, sid: bytes) -> None:
        """A transfer is over without its copy kept: its files are closed, and what an offer wrote goes, with its
        bytes in flight."""
        session = self._sessions.pop(sid, None)
        for writing in [w for w, s in self._writing.items() if s == sid]:
            del self._writing[writing]
        if session is None:
            return
        session.close()
        if session.fds is not None:
            with self._lock:
                self.store.abort(session.key)

    def _failed(self, ident: bytes, msg: m.TierRequest, e: Exception) -> m.TierStored:
        """The answer to a request that raised: the transfer it belongs to ends, and the error is said."""
        node = self.store.node_id
        if isinstance(e, OSError):
            why = os_failure(node, self.store.root, e)
        else:
            log.exception("the memory tier failed on %s", type(msg).__name__)
            why = f"the tier server of {node} failed: {type(e).__name__}: {e}"
        run, checkpoint_dir, rank = (getattr(msg, a, d) for a, d in (("run", ""), ("checkpoint_dir", ""), ("rank", -1)))
        if isinstance(msg, (m.TierChunk, m.TierFetch)) and msg.session:
            self._end(msg.session)
        elif isinstance(msg, (m.TierOffer, m.TierOfferEnd)):
            key = CopyKey(run, checkpoint_dir, rank)
            self._end(self._writing.get((ident, key), b""))
            with self._lock:
                if isinstance(msg, m.TierOffer) and self.store.writing(key) and \
                        not any(s.key == key and s.fds is not None for s in self._sessions.values()):
                    self.store.abort(key)  # begun by this offer, which failed before its transfer opened
        log.warning("a %s of %s rank %s failed: %s", type(msg).__name__, checkpoint_dir or "-", rank, why)
        return m.TierStored(run=run, checkpoint_dir=checkpoint_dir, rank=rank, node_id=node, ok=False, reason=why)

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
            if msg.offset < 0 or msg.offset + len(data) > session.sizes.get(msg.path, 0):
                # The budget counts the declared sizes: nothing is written past them.
                self._end(msg.session)
                return m.TierStored(**ids, node_id=self.store.node_id, ok=False,
                                    reason=f"a chunk of {msg.path} at {msg.offset} ({len(data)} bytes) goes past its "
                                           f"declared {session.sizes.get(msg.path, 0)} bytes: the transfer is refused")
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
            for sid in [sid for sid, sess in self._sessions.items() if sess.key.run == msg.run]:
                self._end(sid)
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
                raise  # answered by _failed, with the path and errno, once what was half-made is gone
            transfer = self._open(key, fds, msg.files)
            self._writing[(ident, key)] = transfer.session
            return m.TierAck(**ids, transfer=transfer)
        if isinstance(msg, m.TierOfferEnd):
            session = self._sessions.pop(self._writing.pop((ident, key), b""), None)
            if session is None:  # ended (silent past the timeout, or failed), or never offered by this sender
                return m.TierStored(**ids, node_id=node, ok=False,
                                    reason=f"no transfer of {msg.checkpoint_dir} rank {msg.rank} from this sender is "
                                           f"open on {node}: it failed, or was silent for "
                                           f"{self._transfer_timeout_s:.0f} s")
            session.close()
            with self._lock:
                # The checksums of what came in order were computed as it was written: nothing is read again.
                why = self.store.finish(key, session.digests.digests())
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
        if not any(f.path == msg.path for f in record.files):  # the copy's own files, nothing else under it
            return m.TierStored(**ids, node_id=self.store.node_id, ok=False,
                                reason=f"{msg.path} is not a file of {msg.checkpoint_dir} rank {msg.rank}")
        try:
            view = file_view(where, msg.path)
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
                    if not isinstance(e, OSError):
                        log.exception("the memory tier failed on %s", type(hold).__name__)
                    reply = m.TierStored(run=hold.run, checkpoint_dir=hold.checkpoint_dir, rank=hold.rank,
                                         node_id=self.store.node_id, ok=False,
                                         reason=os_failure(self.store.node_id, self.store.root, e)
                                         if isinstance(e, OSError) else
                                         f"the tier server failed: {type(e).__name__}: {e}")
                finally:
                    if todo is self._waiting:
                        self._waited(-1)
                out.send_multipart([ident, encode(reply)])
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
            replica = self._push(hold, key, Path(hold.source_dir), peers, owner=self._source_owner)
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

    def _push(self, hold: m.TierHold, key: CopyKey, src: Path, peers: dict[str, zmq.Socket],
              owner: int | None = None) -> tuple[str, str, float]:
        """The replica of the files under `src` on the hold's peer: (the node that keeps it, or "" and why not; seconds)."""
        started = time.monotonic()
        sock = peers.get(hold.peer_address)
        if sock is None:
            sock = peers[hold.peer_address] = connect_dealer(self._ctx, hold.peer_address, key=self._key)
        try:
            turn = self._background_turn if queue_for(hold) == "hold" else None
            stored = push(sock, key, hold.seq, hold.files, src, hold.peer_address, turn=turn, owner=owner)
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

        began = []

        def room(offer: m.TierOffer) -> Path:
            with self._lock:
                admission, partial = self.store.begin(pull.run, pull.checkpoint_dir, pull.rank, offer.seq,
                                                      offer.files, primary=False)
            if partial is None:
                raise TransferError(admission.reason if not admission.admit else "already held")
            began.append(partial)
            return partial

        try:
            offer, digests = fetch(self._ctx, self._key, pull.from_address, key, None, dest_for=room)
        except (TransferError, OSError) as e:
            if began:  # else what is being written of this copy is another writer's
                with self._lock:
                    self.store.abort(key)
            why = os_failure(node, self.store.root, e) if isinstance(e, OSError) else str(e)
            return m.TierStored(**ids, node_id=node, ok=False, reason=f"fetching from {pull.from_address}: {why}",
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
        try:
            with self._lock:
                admission, partial = self.store.begin(hold.run, hold.checkpoint_dir, hold.rank, hold.seq, hold.files)
        except OSError as e:  # begin let its room go
            return f"{hold.checkpoint_dir} rank {hold.rank} was not kept in memory: " \
                   f"{os_failure(self.store.node_id, self.store.root, e)}"
        if partial is None:
            return None if admission.admit else admission.reason
        key = CopyKey(hold.run, hold.checkpoint_dir, hold.rank)
        linked: dict[str, str] = {}
        try:
            for entry in hold.files:
                if hold.link and _linked(hold.source_dir, entry.path, partial, self._source_owner):
                    # The rank's own file, whose checksum it has just taken; every later use checks it again.
                    linked[entry.path] = entry.checksum[1]
                else:
                    safepath.copy_under(hold.source_dir, entry.path, partial, owner=self._source_owner)
        except (OSError, ValueError) as e:
            with self._lock:
                self.store.abort(key)
            why = os_failure(self.store.node_id, self.store.root, e) if isinstance(e, OSError) else str(e)
            return f"{hold.checkpoint_dir} rank {hold.rank} was not kept in memory: {why}"
        with self._lock:
            return self.store.finish(key, linked)



def start_tier(ctx: zmq.Context, key: ClusterKey | None, node_id: str, host: str, budget_bytes: int,
               root: Path | None = None, fitted: bool = False, source_owner: int | None = None) -> TierServer | None:
    """The node's tier, its copies reclaimed from an earlier agent of the node; None with no budget.
    `source_owner`: the uid whose files a rank's hold may name (--worker-user's).

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
    server = TierServer(ctx, key, store, host, source_owner=source_owner).start()
    log.info("keeping checkpoint copies in memory: up to %.2f GiB in %s, served at %s", budget_bytes / 2**30,
             store.home, server.address)
    return server


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


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path
