"""The memory tier of a simulated node, and the driver's requests to it, on the virtual clock.

What is simulated is what moves bytes: a copy into the node's RAM, a replica pushed to a peer, a
pull from a peer, each taking virtual time, and the RAM itself (a dict of bytes, lost with the
machine, kept by a persistent agent started again, corrupted by a fault). Every decision is the
real code's: the budget and its evictions are a real `TierBook` (`outlast/storage/memtier.py`,
`begin` and `finish` as `TierStore` calls them), what to ask of which node is the controller's
(`outlast/controller/commits/holds.py`), and what a restore reads is `tier_restore.choose_copies`.

A node's tier server answers what a commit or a restore waits for (a hold with files to copy in, a
pull) on one thread, a replica of a copy held already on another, and an upload on a third
(`tier_schedule.queue_for`): three queues here, chosen by the same function. The
driver's requests go out on a pool of `POOL` threads (`tier_executor.py`), each waiting for its
answer for the request's timeout, which answers for a node that died with the request.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Generator

import msgspec

from outlast.agent.tier_schedule import queue_for
from outlast.controller import effects as fx
from outlast.protocol import messages as m
from outlast.sim.world import Channel
from outlast.storage.checksum import new_hasher
from outlast.storage.memtier import Copy, CopyKey, TierBook
from outlast.storage.tier_store import TierRecord

if TYPE_CHECKING:
    from outlast.sim.agent_node import AgentNode
    from outlast.sim.driver import SimDriver

COPY_S = (0.001, 0.05)  # a rank's files into the node's RAM
TRANSFER_S = (0.005, 0.5)  # a copy to or from a peer
PEER_TIMEOUT_S = 30.0  # tier_client's: a peer silent this long fails the transfer
POOL = 4  # the driver's TierExecutor threads
COPY_BYTES = 64  # what one rank's files of one checkpoint take in a tier schedule


def check(data: dict[str, bytes], entry: m.FileEntry) -> str | None:
    """As `tier_store.check_files` checks a file on disk: present, its size, then its checksum."""
    got = data.get(entry.path)
    if got is None:
        return f"file {entry.path} is missing"
    if len(got) != entry.size:
        return f"file {entry.path} has {len(got)} bytes, the record says {entry.size}"
    algorithm, expected = entry.checksum
    hasher = new_hasher(algorithm)
    hasher.update(got)
    if hasher.hexdigest() != expected:
        return f"file {entry.path} does not match its checksum ({algorithm})"
    return None


def check_all(data: dict[str, bytes], files: list[m.FileEntry]) -> str | None:
    return next((why for e in files if (why := check(data, e)) is not None), None)


class SimTier:
    def __init__(self, node: "AgentNode", budget_bytes: int) -> None:
        self.node, self.sim = node, node.sim
        self.book = TierBook(budget_bytes)
        self.records: dict[CopyKey, TierRecord] = {}
        self.data: dict[CopyKey, dict[str, bytes]] = {}  # the RAM: path -> bytes of each copy held
        self.stored_in: dict[CopyKey, int] = {}  # the agent's incarnation that took each copy in
        self._pending: dict[CopyKey, TierRecord] = {}
        self._queues: dict[str, deque] = {"waited": deque(), "hold": deque(), "upload": deque()}
        self._busy: dict[str, bool] = {"waited": False, "hold": False, "upload": False}
        self._begun_why = ""

    @property
    def address(self) -> str:
        return f"sim-tier://{self.node.node_id}/{self.node.incarnations}"

    def up(self, incarnation: int) -> bool:
        return self.node.alive and self.node.incarnations == incarnation

    # ---- the node's life ---------------------------------------------------------------------------

    def lose(self) -> None:
        """The machine is gone: its RAM with it."""
        self.book = TierBook(self.book.budget_bytes)
        self.records.clear()
        self.data.clear()
        self.stored_in.clear()
        self.reclaim()

    def reclaim(self) -> None:
        """The agent starts again: its threads' work is gone, the partial copies dropped, the whole ones kept
        (`TierStore.open`: sizes only; checksums are every restore's)."""
        for key in list(self._pending):
            self._abort(key)
        for q in self._queues.values():
            q.clear()
        self._busy = dict.fromkeys(self._busy, False)

    def corrupt(self, key: CopyKey) -> None:
        """A bit flips in RAM: the size stays, the checksum no longer matches."""
        files = self.data[key]
        path = sorted(files)[0]
        b = bytearray(files[path])
        b[0] ^= 0x01
        files[path] = bytes(b)

    def held(self, run: str, checkpoint_dir: str) -> list[tuple[TierRecord, dict[str, bytes]]]:
        """The copies of a checkpoint held here, as `tier_restore.held_here` lists them."""
        return [(r, self.data[k]) for k, r in sorted(self.records.items()) if k.run == run
                and k.checkpoint_dir == checkpoint_dir]

    # ---- requests -----------------------------------------------------------------------------------

    def receive(self, msg: m.Msg, reply: Callable[[m.TierReply], None]) -> None:
        if not self.node.alive:
            return  # nobody answers: the asker's timeout does
        if isinstance(msg, (m.TierHold, m.TierPull, m.TierUpload)):
            q = queue_for(msg)
            self._queues[q].append((msg, reply))
            self._next(q)
        elif isinstance(msg, m.TierCommit):
            self._commit(msg.run, msg.checkpoint_dir)
            reply(m.TierAck(run=msg.run, checkpoint_dir=msg.checkpoint_dir, rank=-1))
        elif isinstance(msg, m.TierFree):
            for key in [k for k in self.records if k.run == msg.run]:
                self._drop(key)
            reply(m.TierAck(run=msg.run, checkpoint_dir="", rank=-1))

    def _next(self, q: str) -> None:
        if self._busy[q] or not self._queues[q]:
            return
        msg, reply = self._queues[q].popleft()
        self._busy[q] = True
        work = self._pull(msg) if isinstance(msg, m.TierPull) else self._upload(msg) \
            if isinstance(msg, m.TierUpload) else self._hold(msg)
        self._step(q, work, reply, self.node.incarnations)

    def _step(self, q: str, work: Generator, reply, incarnation: int) -> None:
        if not self.up(incarnation):
            work.close()  # what it had begun on a peer is let go there (the peer's sweep of a silent sender)
            return  # the agent died with the request: never answered
        try:
            wait = work.send(None)
        except StopIteration as done:
            reply(done.value)
            self._busy[q] = False
            self._next(q)
            return
        self.sim.world.after(wait, self._step, q, work, reply, incarnation)

    def _wait(self, span: tuple[float, float]) -> float:
        return self.sim.world.rng.uniform(*span)

    # ---- what the tier server's hold thread does ------------------------------------------------------

    def _hold(self, hold: m.TierHold) -> Generator[float, None, m.TierStored]:
        node = self.node.node_id
        ids = dict(run=hold.run, checkpoint_dir=hold.checkpoint_dir, rank=hold.rank)
        nbytes = sum(f.size for f in hold.files)
        key = CopyKey(hold.run, hold.checkpoint_dir, hold.rank)
        replica: tuple[str, str] | None = None
        if key not in self.records and hold.peer_address:
            # The server pushes the replica from the rank's own files while it copies them in: the push here,
            # then the copy, whose time the push's covered.
            source = self.node.local.get(hold.source_dir) or {}
            if all(e.path in source for e in hold.files):
                replica = yield from self._replica(key, hold, {e.path: source[e.path] for e in hold.files})
            else:
                replica = "", f"the replica to {hold.peer_address} failed: no such file in {hold.source_dir}"
            why = yield from self._copy_in(hold, key)
        elif key not in self.records:
            why = yield from self._copy_in(hold, key)
        else:
            why = None
        if why is not None:
            replica_node, replica_reason = replica or ("", "")
            return m.TierStored(**ids, node_id=node, ok=False, reason=why, nbytes=nbytes, replica_node=replica_node,
                                replica_reason=replica_reason)
        src = self.data.get(key)
        if replica is None and hold.peer_address and src is not None:
            replica = yield from self._replica(key, hold, dict(src))
        replica_node, replica_reason = replica or ("", "")
        return m.TierStored(**ids, node_id=node, ok=src is not None, nbytes=nbytes,
                            reason="" if src is not None else "evicted before its replica was made",
                            replica_node=replica_node, replica_reason=replica_reason)

    def _replica(self, key: CopyKey, hold: m.TierHold, data: dict[str, bytes]) -> Generator[float, None, tuple[str, str]]:
        stored, failed = yield from self._push(key, hold.seq, hold.files, data, hold.peer_address)
        if stored is not None and stored.ok:
            return stored.node_id, ""
        if stored is not None:
            return "", f"{stored.node_id} did not keep the replica: {stored.reason}"
        return "", f"the replica to {hold.peer_address} failed: {failed}"

    def _copy_in(self, hold: m.TierHold, key: CopyKey) -> Generator[float, None, str | None]:
        if self._begin(key, hold.seq, hold.files, primary=True) is not None:
            return self._begun_why
        yield self._wait(COPY_S)
        src = self.node.local.get(hold.source_dir)
        if src is None or any(e.path not in src for e in hold.files):
            self._abort(key)
            return f"{hold.checkpoint_dir} rank {hold.rank} was not kept in memory: no such file in {hold.source_dir}"
        return self._finish(key, {e.path: src[e.path] for e in hold.files})

    def _push(self, key: CopyKey, seq: int, files: list[m.FileEntry], data: dict[str, bytes],
              address: str) -> Generator[float, None, tuple[m.TierStored | None, str]]:
        """`tier_client.push`: an offer, the chunks, the end; the peer's answer, or why there is none."""
        peer = self.sim.tier_at(address)
        if peer is None:
            yield PEER_TIMEOUT_S
            return None, f"no answer from {address} for {PEER_TIMEOUT_S:.0f} s"
        incarnation = peer.node.incarnations
        refused = peer.offer(key, seq, files)
        yield self._wait((0.0005, 0.005))
        if refused is not None:
            return refused, ""
        try:
            yield self._wait(TRANSFER_S)
        except GeneratorExit:
            # This sender died mid-transfer: the peer lets its bytes in flight go (`TierServer`'s sweep of a
            # transfer silent past its timeout).
            if peer.up(incarnation):
                peer._abort(key)
            raise
        if not peer.up(incarnation):
            yield PEER_TIMEOUT_S
            return None, f"no answer from {address} for {PEER_TIMEOUT_S:.0f} s"
        why = peer._finish(key, data)
        return m.TierStored(run=key.run, checkpoint_dir=key.checkpoint_dir, rank=key.rank, node_id=peer.node.node_id,
                            ok=why is None, reason=why or ""), ""

    def _pull(self, pull: m.TierPull) -> Generator[float, None, m.TierStored]:
        node = self.node.node_id
        ids = dict(run=pull.run, checkpoint_dir=pull.checkpoint_dir, rank=pull.rank)
        key = CopyKey(pull.run, pull.checkpoint_dir, pull.rank)
        record = self.records.get(key)
        if record is not None and check_all(self.data[key], record.files) is None:
            return m.TierStored(**ids, node_id=node, ok=True, reason="already held", nbytes=record.nbytes)
        if record is not None:  # `TierStore.verify`: a copy that rotted is dropped, and fetched again
            self._drop(key)
        src = self.sim.tier_at(pull.from_address)

        def failed(why: str) -> m.TierStored:
            self._abort(key)
            return m.TierStored(**ids, node_id=node, ok=False, reason=f"fetching from {pull.from_address}: {why}")

        if not pull.from_address:  # the tier server's hold thread: zmq refuses no address at once
            return m.TierStored(**ids, node_id=node, ok=False,
                                reason="the tier server failed: ZMQError: Invalid argument")
        if src is None:
            yield PEER_TIMEOUT_S
            return failed(f"no answer from {pull.from_address} for {PEER_TIMEOUT_S:.0f} s")
        incarnation = src.node.incarnations
        offer = src.records.get(key)
        yield self._wait((0.0005, 0.005))
        if offer is None:
            return failed(f"{pull.checkpoint_dir} rank {pull.rank} is not held on {src.node.node_id}")
        if self._begin(key, offer.seq, offer.files, primary=False) is not None:
            # Not begun: what is being written of this copy is another writer's, not to be let go here.
            return m.TierStored(**ids, node_id=node, ok=False,
                                reason=f"fetching from {pull.from_address}: {self._begun_why or 'already held'}")
        yield self._wait(TRANSFER_S)
        if not src.up(incarnation) or key not in src.data:
            if not src.up(incarnation):
                yield PEER_TIMEOUT_S
                return failed(f"no answer from {pull.from_address} for {PEER_TIMEOUT_S:.0f} s")
            return failed(f"{pull.checkpoint_dir} rank {pull.rank} is not held on {src.node.node_id}")
        why = self._finish(key, dict(src.data[key]))
        if why is None:
            self._commit(pull.run, pull.checkpoint_dir)  # `TierServer._pull`: what a restore reads is committed
        return m.TierStored(**ids, node_id=node, ok=why is None, reason=why or "", nbytes=offer.nbytes)

    def _upload(self, up: m.TierUpload) -> Generator[float, None, m.TierStored]:
        """The held copy, checked against its record, uploaded to the run's storage (its upload thread)."""
        node = self.node.node_id
        ids = dict(run=up.run, checkpoint_dir=up.checkpoint_dir, rank=up.rank)
        key = CopyKey(up.run, up.checkpoint_dir, up.rank)
        record = self.records.get(key)
        if record is None:
            return m.TierStored(**ids, node_id=node, ok=False, reason=f"{up.checkpoint_dir} rank {up.rank} is not "
                                f"held on {node}")
        data = self.data[key]
        why = check_all(data, record.files)
        if why is not None:
            self._drop(key)
            return m.TierStored(**ids, node_id=node, ok=False, reason=f"the copy of rank {up.rank} in memory on "
                                f"{node} was not uploaded: {why}")
        storage = self.sim.storage
        saved, storage.spent = storage.spent, 0.0
        try:
            for entry in record.files:
                path = f"run/{up.checkpoint_dir}/{entry.path}"
                if up.replace or path not in storage.files:
                    storage.write_atomic(path, data[entry.path])
            failed = None
        except OSError as e:
            failed = f"uploading from {node}'s memory to {up.run}/{up.checkpoint_dir} failed: OSError: {e}"
        took, storage.spent = storage.spent, saved
        yield took + self._wait(TRANSFER_S)
        if failed is not None:
            return m.TierStored(**ids, node_id=node, ok=False, reason=failed)
        return m.TierStored(**ids, node_id=node, ok=True, nbytes=record.nbytes)

    # ---- what the tier server's own thread does (a peer's offer) ----------------------------------------

    def offer(self, key: CopyKey, seq: int, files: list[m.FileEntry]) -> m.TierStored | None:
        """A peer offers a replica: room is made for it now (`TierStore.begin`); None when it is taken."""
        if self._begin(key, seq, files, primary=False) is None:
            return None
        return m.TierStored(run=key.run, checkpoint_dir=key.checkpoint_dir, rank=key.rank, node_id=self.node.node_id,
                            ok=False, reason=self._begun_why or "already held")

    # ---- the store: its decisions are the real TierBook's --------------------------------------------

    def _begin(self, key: CopyKey, seq: int, files: list[m.FileEntry], primary: bool) -> str | None:
        """`TierStore.begin`: None when the copy may be written now, else a mark (why in `_begun_why`, empty
        when it is held already)."""
        record = TierRecord(run=key.run, checkpoint_dir=key.checkpoint_dir, rank=key.rank, seq=seq, files=list(files),
                            stored_at=self.sim.world.now, primary=primary)
        admission, evicted = self.book.begin(record.copy())
        self._evicted(evicted)
        if not admission.admit or key in self.records:
            self._begun_why = "" if admission.admit else admission.reason
            return "not begun"
        self._pending[key] = record
        return None

    def _finish(self, key: CopyKey, written: dict[str, bytes]) -> str | None:
        """`TierStore.finish`: the written files checked against their record, then kept if they still fit."""
        record = self._pending.pop(key, None)
        if record is None:
            return f"{key.checkpoint_dir} rank {key.rank} was not being written"
        why = check_all(written, record.files)
        if why is not None:
            self.book.abort(key)
            return f"{key.checkpoint_dir} rank {key.rank} was not kept in memory: {why}"
        admission, evicted = self.book.finish(record.copy())
        if not admission.admit:
            return admission.reason
        self._evicted(evicted)
        self.records[key] = record
        self.data[key] = written
        self.stored_in[key] = self.node.incarnations
        return None

    def _commit(self, run: str, checkpoint_dir: str) -> None:
        self.book.mark_committed(run, checkpoint_dir)
        for key, r in list(self.records.items()):
            if key.run == run and key.checkpoint_dir == checkpoint_dir:
                self.records[key] = msgspec.structs.replace(r, committed=True)

    def _abort(self, key: CopyKey) -> None:
        """`TierStore.abort`: a copy being written that will not be; its bytes in flight are let go."""
        if self._pending.pop(key, None) is not None:
            self.book.abort(key)

    def _evicted(self, copies: list[Copy]) -> None:
        for c in copies:
            self.records.pop(c.key, None)
            self.data.pop(c.key, None)
            self.stored_in.pop(c.key, None)
        if copies:
            self.sim.observer.evicted(self.node.node_id, copies)

    def _drop(self, key: CopyKey) -> None:
        self.book.drop(key)
        self.records.pop(key, None)
        self.data.pop(key, None)
        self.stored_in.pop(key, None)


class SimTierAsks:
    """The driver's `TierExecutor`: its requests on `POOL` threads, each answered by the node or, past the
    request's timeout, by the executor saying nobody answered."""

    def __init__(self, driver: "SimDriver") -> None:
        self._driver = driver
        self._sim = driver.sim
        self._todo: deque[fx.TierAsk] = deque()
        self._running = 0

    def submit(self, effect: fx.TierAsk) -> None:
        self._todo.append(effect)
        self._next()

    def _next(self) -> None:
        while self._running < POOL and self._todo:
            self._running += 1
            self._ask(self._todo.popleft())

    def _ask(self, effect: fx.TierAsk) -> None:
        sim, answered = self._sim, [False]

        def answer(event: fx.TierAnswered) -> None:
            if answered[0]:
                return
            answered[0] = True
            self._running -= 1
            self._driver.deliver(event)
            self._next()

        if not effect.address:  # zmq refuses to connect to no address at once
            sim.world.after(0.0, answer, fx.TierAnswered(effect.id, error=f"the memory tier of {effect.node_id} did "
                                                                         "not answer: Invalid argument"))
            return
        tier = sim.tier_at(effect.address)
        if tier is not None:
            there, back = Channel(sim.world, sim.schedule.max_delay_s), Channel(sim.world, sim.schedule.max_delay_s)
            there.send(tier.receive, effect.msg,
                       lambda reply: back.send(answer, fx.TierAnswered(effect.id, reply=reply)))
        sim.world.after(effect.timeout_s, answer, fx.TierAnswered(
            effect.id, error=f"the memory tier of {effect.node_id} did not answer: no answer for "
                             f"{effect.timeout_s:.0f} s"))
