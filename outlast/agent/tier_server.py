"""A node's tier server: keeps checkpoint copies in memory and trades them with peers.

Four threads of the agent's process, none of them its poll loop, which never waits on
a copy; they carry out what the schedule decides (`tier_schedule.py`: which thread a request
waits for, the transfers in flight and their timeouts, replicas held back while the node
drains) and keep no state of their own. The server thread owns a ROUTER socket (CURVE, the
cluster key: the same authenticator as the agent's) and a plain one for the bytes of copies,
sealed under a key each transfer gets over the first (`tier_client.TransferSealer`), and answers what
takes a chunk's time at most (`tier_answers.py`). The hold threads do what takes a copy's time
(`tier_work.py`): a `TierHold` copies a rank's files in, then pushes the replica to the peer
named in it, and its answer (`TierStored`, with both nodes and the seconds each took) goes back
through the server thread once the replica is there or has failed. What a commit or a restore
waits for (a hold that copies a rank's files in, with the replica of a checkpoint committed in
memory, such as a drain's; a pull) has a thread of its own, so that it never waits behind a
replica made beside a durable commit; so has a `TierUpload` (a held copy, checked, uploaded to
the run's storage: a drain's checkpoint committed in memory), which takes storage's time.

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

import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import zmq

from outlast.agent.tier_answers import TierAnswers
from outlast.agent.tier_client import CHUNK
from outlast.agent.tier_schedule import Queue, ReplicaGate, Transfers, queue_for
from outlast.agent.tier_work import TierWork
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.protocol.transport import TIER_REQUESTS, BadMessage, bind_router, encode
from outlast.storage.tier_store import TierStore, default_root
from outlast.trace import mark

log = logging.getLogger("outlast.agent.tier")

# A transfer unused this long is ended (its asker died, or closed its socket), what it wrote with it: twice
# tier_client's 30 s, after which a live asker has given up anyway.
TRANSFER_TIMEOUT_S = float(os.environ.get("OUTLAST_TIER_TRANSFER_TIMEOUT_S", "60"))

Asked = tuple[bytes, m.TierHold | m.TierPull | m.TierUpload, float]  # (asker, request, when it came)


class TierServer:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], key: ClusterKey | None, store: TierStore, host: str = "127.0.0.1",
                 port: int = 0, transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
                 source_owner: int | None = None) -> None:
        self._ctx = ctx
        self.store = store
        self._lock = threading.Lock()  # the store: every thread uses it
        self._sock, self.address = bind_router(ctx, host, port, key)
        # Sealed bytes only (see the module); a socket without the cluster key takes no frame larger than a sealed
        # chunk from anyone.
        self._data, self.data_address = bind_router(ctx, host, 0, None, max_frame=CHUNK + (64 << 10))
        self.answers = TierAnswers(store, self._lock, Transfers(store.node_id, transfer_timeout_s),
                                   self.data_address)
        # --worker-user: the agent is root, and a rank's files must be its workers' user's (a hold naming another
        # run's copy in this tier, or a file of root's, is refused).
        self.work = TierWork(ctx, key, store, self._lock, self._background_turn, source_owner)
        self._replies = f"inproc://outlast-tier-{id(self)}"
        # What a commit or a restore waits for ("waited") never queues behind a replica made beside a durable
        # commit ("hold"; seen: a drain's 2 GB checkpoint missed its 10 s deadline behind the replica of the
        # checkpoint before it); uploads take storage's time, on a thread of their own, so that no pull or replica
        # waits on one.
        self._queues: dict[Queue, queue.Queue[Asked | None]] = {q: queue.Queue() for q in ("hold", "waited", "upload")}
        self._stop = threading.Event()
        self._gate = ReplicaGate()  # under `_turn`: the agent's thread, the server's and the hold threads use it
        self._turn = threading.Condition()
        self._inbox = ctx.socket(zmq.PULL)
        self._inbox.bind(self._replies)
        self._loops: dict[str, Callable[[], None]] = {
            "outlast-tier": self._serve,
            **{f"outlast-tier-{q}": partial(self._hold_loop, q) for q in self._queues}}
        self._threads = {name: self._thread(name) for name in self._loops}
        self._died: dict[str, str] = {}  # thread name -> why it ended, until `watch` starts it again

    def drain(self, deadline_unix_s: float | None) -> None:
        """The node drains: replicas beside durable commits wait (`ReplicaGate`)."""
        with self._turn:
            self._gate.drain(deadline_unix_s, time.time())
            self._turn.notify_all()

    def _background_turn(self) -> None:
        """Returns when a replica beside a durable commit may go on (or the server stops)."""
        with self._turn:
            while not self._stop.is_set() and not (gate := self._gate.may_go(time.time())).go:
                self._turn.wait(min(gate.wait_s, 1.0))  # woken sooner by a drain or a waited request's end

    def start(self) -> "TierServer":
        for t in self._threads.values():
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for todo in self._queues.values():
            todo.put(None)
        for t in self._threads.values():
            t.join(timeout=10)

    def _thread(self, name: str) -> threading.Thread:
        target = self._loops[name]

        def run() -> None:
            try:
                target()
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
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(200):
                    if sock is self._inbox:
                        ident, data = self._inbox.recv_multipart()
                        self._sock.send_multipart([ident, data])
                    else:
                        self._answer(sock)
                for ended in self.answers.transfers.sweep(time.monotonic()):
                    if ended.transfer.is_offer:  # a fetch's asker lost nothing here
                        log.warning("%s", ended.reason)
                    self.answers.let_go(ended.transfer)
        finally:
            if self._stop.is_set():  # else `watch` starts the loop again, on the same sockets and transfers
                self.answers.close()
                self._sock.close(linger=0)
                self._data.close(linger=0)
                self._inbox.close(linger=0)

    def _answer(self, sock: zmq.Socket[bytes]) -> None:
        frames = sock.recv_multipart(copy=False)
        if len(frames) < 2:
            return
        ident, head = frames[0].bytes, frames[1].bytes
        try:
            msg = TIER_REQUESTS.decode(head)
        except BadMessage as e:
            # A path outside its copy, a field of the wrong type: refused whole, and the asker told.
            log.warning("refused a malformed tier request: %s", e)
            sock.send_multipart([ident, encode(m.TierStored(
                run="", checkpoint_dir="", rank=-1, node_id=self.store.node_id, ok=False,
                reason=f"{self.store.node_id} refused a request that does not decode: {e}"))])
            return
        now = time.monotonic()
        reply: m.TierReply | list[bytes | memoryview] | None = None  # None: answered later, or not at all
        try:
            if sock is self._data:
                # A chunk's sealed bytes are the frame after its header (tier_client.TransferSealer.seal).
                reply = self.answers.data(msg, head, frames[2].buffer if len(frames) > 2 else b"", now)
            elif isinstance(msg, (m.TierHold, m.TierPull, m.TierUpload)):
                self._enqueue(ident, msg, now)  # answered by a hold thread, through the inbox
            else:
                reply = self.answers.request(ident, msg, now)
        except Exception as e:  # noqa: BLE001 - the request's answer; the thread goes on
            reply = self.answers.failed(ident, msg, e)
        if isinstance(reply, list):  # a chunk's frames: tracked, so that its buffer is sealed into again once sent
            self.answers.sent(sock.send_multipart([ident, *reply], copy=False, track=True))
        elif reply is not None:
            sock.send_multipart([ident, encode(reply)])

    def _enqueue(self, ident: bytes, msg: m.TierHold | m.TierPull | m.TierUpload, now: float) -> None:
        """A request for a hold thread, answered by it through the inbox once carried out."""
        which = queue_for(msg)
        if which == "waited":
            with self._turn:
                self._gate.waited_began()
                self._turn.notify_all()
        self._queues[which].put((ident, msg, now))

    # -- the hold threads ----------------------------------------------------------------------

    def _hold_loop(self, which: Queue) -> None:
        todo = self._queues[which]
        out = self._ctx.socket(zmq.PUSH)
        out.connect(self._replies)
        peers: dict[str, zmq.Socket[bytes]] = {}
        try:
            while (item := todo.get()) is not None:
                ident, asked, asked_at = item
                mark("tier.begin", kind=type(asked).__name__)
                try:
                    reply = self.work.answer(asked, asked_at, peers)
                finally:
                    if which == "waited":
                        with self._turn:
                            self._gate.waited_ended()
                            self._turn.notify_all()
                mark("tier.end", kind=type(asked).__name__)
                out.send_multipart([ident, encode(reply)])
        finally:
            for sock in peers.values():
                sock.close(linger=0)
            out.close(linger=0)


def start_tier(ctx: zmq.Context[zmq.Socket[bytes]], key: ClusterKey | None, node_id: str, host: str, budget_bytes: int,
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


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path
