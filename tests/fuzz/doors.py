"""The doors a fuzzer knocks on: each sends one generated case, gathers what came back, and says whether
the process behind it is still up and answers a valid request.

A door is driven the same way by the tests (a few cases, Hypothesis choosing them) and by
bench/fuzz_doors.py (100,000 and more): `knock(h)` sends one case drawn from the `Hostile` `h`,
`alive()` returns None when the process answers a valid request (else why not), `answers` counts what
came back by class. Nothing a case names may appear in the canary directory (`outside_writes`), and no
answer may carry the canary secret's bytes (`secrets_read`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path

import msgspec
import zmq

from outlast.agent.tier_client import ASKER, TransferSealer, new_transfer
from outlast.protocol import messages as m
from outlast.protocol.auth import ClusterKey
from outlast.protocol.transport import (AGENT_EVENTS, FROM_ZYGOTE, HEAD_TO_MEMBER, HEADER, TIER_REPLIES, TO_ZYGOTE,
                                        BadMessage, connect_dealer, encode)
from outlast.storage.checksum import new_hasher
from tests.fuzz.hostile import Hostile, classes_of

MARKER = b"canary-secret-4f1c9e"  # what the canary's secret file holds: no answer may carry it
ANSWER_S = 30.0  # a loaded machine answers slowly; a process that is down never does


def plant_canary(root: Path) -> Path:
    """A directory outside every root of the process under test: a secret file, and nothing else may appear."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "secret.txt").write_bytes(MARKER + b"\n")
    return root


def outside_writes(canary: Path) -> list[str]:
    """What appeared in the canary directory (and beside it, under its parent) since it was planted."""
    found = sorted(str(p) for p in canary.rglob("*") if p.name != "secret.txt")
    found += sorted(str(p) for p in canary.parent.iterdir() if p.name.startswith(canary.name) and p != canary)
    return found


def _xxh3(data: bytes) -> str:
    hasher = new_hasher("xxh3_128")
    hasher.update(data)
    return hasher.hexdigest()


class Door:
    name = ""

    def __init__(self) -> None:
        self.answers: Counter[str] = Counter()
        self.secrets_read = 0

    def _count(self, data: bytes, codec) -> None:
        if MARKER in data:
            self.secrets_read += 1
        try:
            msg = codec.decode(data)
        except BadMessage:
            try:
                msg = HEAD_TO_MEMBER.decode(data)  # a HeartbeatAck: the head's answer to a NodeHeartbeat
            except BadMessage:
                self.answers["malformed answer"] += 1
                return
        name = type(msg).__name__
        if isinstance(msg, m.TierStored) and not msg.ok:
            name += "(refused)"
        elif isinstance(msg, m.OutputLines) and msg.error:
            name += "(refused)"
        self.answers[name] += 1

    def knock(self, h: Hostile) -> None:
        raise NotImplementedError

    def alive(self) -> str | None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _send(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Never blocks: with the peer gone a DEALER has nowhere to queue, and `alive` is what says so."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        pass


def _recv_all(sock: zmq.Socket) -> list[list[bytes]]:
    out = []
    while True:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return out


class AgentDoor(Door):
    """The agent's control socket, as a peer holding the cluster key: every request but `Shutdown` and
    `DrainNode`, which stop or drain the node as a key holder may."""

    name = "agent"
    CLASSES = [c for c in classes_of(m.AgentRequest) if c not in (m.Shutdown, m.DrainNode)]

    def __init__(self, address: str, key: ClusterKey, proc=None) -> None:
        super().__init__()
        self.ctx = zmq.Context()
        self.address, self.key, self.proc = address, key, proc
        self.sock = connect_dealer(self.ctx, address, key=key)
        self.probe = connect_dealer(self.ctx, address, key=key)
        self.runs: set[str] = set()

    def knock(self, h: Hostile) -> None:
        frames = h.multipart(self.CLASSES)
        if h.rng.random() < 0.15:
            frames = [self._spawn(h)]
        _send(self.sock, frames)
        for (data, *_rest) in _recv_all(self.sock):
            self._count(data, AGENT_EVENTS)

    def _spawn(self, h: Hostile) -> bytes:
        """A spawn with hostile fields that does fork (its workers a few, their payload not a pickle): the run
        is ended when the batch is (`alive`), as its driver would."""
        msg = h.message(h.rng.choice([m.SpawnWorkers, m.SpawnTask]))
        if isinstance(msg.get("workers"), list):
            msg["workers"] = msg["workers"][:2]
        msg["agent_pid"] = 0
        if isinstance(msg.get("run_id"), str):
            self.runs.add(msg["run_id"])
        return HEADER + msgspec.msgpack.encode(msg)

    def alive(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            return f"the agent exited with {self.proc.returncode}"
        for run in self.runs:
            _send(self.probe, [encode(m.EndRun(run_id=run))])
        self.runs.clear()
        _send(self.probe, [encode(m.Ping())])
        deadline = time.monotonic() + ANSWER_S
        while (left := deadline - time.monotonic()) > 0:
            if not self.probe.poll(int(left * 1000)):
                break
            try:
                if isinstance(AGENT_EVENTS.decode(self.probe.recv()), m.Pong):
                    for (data, *_rest) in _recv_all(self.sock):
                        self._count(data, AGENT_EVENTS)
                        return None
                    return None
            except BadMessage:
                continue
        return f"the agent at {self.address} did not answer a Ping within {ANSWER_S:.0f} s"

    def close(self) -> None:
        self.sock.close(linger=0)
        self.probe.close(linger=0)
        self.ctx.term()


class TierDoor(Door):
    """The tier server's request socket (CURVE, the cluster key), as a peer holding the key."""

    name = "tier"
    CLASSES = classes_of(m.TierRequest)

    def __init__(self, address: str, key: ClusterKey) -> None:
        super().__init__()
        self.ctx = zmq.Context()
        self.address = address
        self.sock = connect_dealer(self.ctx, address, key=key)
        self.probe = connect_dealer(self.ctx, address, key=key)

    def knock(self, h: Hostile) -> None:
        _send(self.sock, h.multipart(self.CLASSES))
        for (data, *_rest) in _recv_all(self.sock):
            self._count(data, TIER_REPLIES)

    def alive(self) -> str | None:
        return _tier_answers(self.probe, self.address)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.probe.close(linger=0)
        self.ctx.term()


def _tier_answers(probe: zmq.Socket, address: str) -> str | None:
    _send(probe, [encode(m.TierList())])
    deadline = time.monotonic() + ANSWER_S
    while (left := deadline - time.monotonic()) > 0 and probe.poll(int(left * 1000)):
        try:
            if isinstance(TIER_REPLIES.decode(probe.recv()), m.TierHoldings):
                return None
        except BadMessage:
            continue
    return f"the tier server at {address} did not answer a TierList within {ANSWER_S:.0f} s"


class TierDataDoor(Door):
    """The tier server's data socket (plain: anyone reaches it). Half the cases come from a stranger (no
    transfer of theirs is open); half from a key holder inside a transfer it opened, each chunk sealed under
    that transfer's key, so its hostile path, offset, length and nonce reach the server's handling."""

    name = "tier-data"

    def __init__(self, address: str, key: ClusterKey) -> None:
        super().__init__()
        self.ctx = zmq.Context()
        self.address = address
        self.control = connect_dealer(self.ctx, address, key=key)
        self.probe = connect_dealer(self.ctx, address, key=key)
        self.data: zmq.Socket | None = None
        self.offer: tuple[m.Transfer, m.TierOffer] | None = None
        self.fetch: tuple[m.Transfer, m.TierOffer] | None = None
        self.opened = 0

    def _ask(self, msg: m.Msg) -> m.TierReply | None:
        self.control.send(encode(msg))
        if not self.control.poll(int(ANSWER_S * 1000)):
            return None
        return TIER_REPLIES.decode(self.control.recv())

    def _open_transfers(self) -> None:
        """An offer left open (files to write), and a fetch of a copy held (files to read), both this door's."""
        self.opened += 1
        run, ckpt = f"fuzz-{os.getpid()}-{self.opened}", "checkpoint_000001"
        body = b"fuzz" * 16
        entry = m.FileEntry(path="w.bin", size=len(body), xxh3_128=_xxh3(body))
        held = m.TierOffer(run=run, checkpoint_dir=ckpt, rank=0, seq=1, files=[entry])
        ack = self._ask(held)
        if isinstance(ack, m.TierAck) and ack.transfer is not None:
            data = connect_dealer(self.ctx, ack.transfer.data_address)
            _send(data, TransferSealer(ack.transfer, ASKER).seal(
                m.TierChunk(run=run, checkpoint_dir=ckpt, rank=0, path="w.bin", offset=0), body))
            data.poll(int(ANSWER_S * 1000))
            data.close(linger=0)
            self._ask(m.TierOfferEnd(run=run, checkpoint_dir=ckpt, rank=0))
        offer = self._ask(m.TierFetch(run=run, checkpoint_dir=ckpt, rank=0))
        if isinstance(offer, m.TierOffer) and offer.transfer is not None:
            self.fetch = (offer.transfer, offer)
        writing = m.TierOffer(run=run + "-w", checkpoint_dir=ckpt, rank=0, seq=1, files=[entry])
        ack = self._ask(writing)
        if isinstance(ack, m.TierAck) and ack.transfer is not None:
            self.offer = (ack.transfer, writing)
        if self.data is None:
            address = (self.offer or self.fetch or (new_transfer(""), None))[0].data_address
            if address:
                self.data = connect_dealer(self.ctx, address)

    def knock(self, h: Hostile) -> None:
        if self.opened == 0:
            self._open_transfers()  # again after each check (`alive`), not at every case of a server that is gone
            if self.data is not None and self.fetch is not None:
                # What issue 30 (item 3) found, sent every time: a file outside the copy, fetched inside its transfer.
                transfer, offer = self.fetch
                # Written as a raw frame: such a message cannot be made (its path is checked when it is built).
                _send(self.data, [HEADER + msgspec.msgpack.encode(dict(
                    type="TierFetch", run=offer.run, checkpoint_dir=offer.checkpoint_dir, rank=0,
                    path=h.targets.paths()[1], length=4096, session=transfer.session))])
        if self.data is None:
            return
        r = h.rng.random()
        if r < 0.5:  # a stranger: whatever it sends, with no transfer of its own
            _send(self.data, h.multipart([m.TierChunk, m.TierFetch]) + [h.raw()] * h.rng.randint(0, 1))
        else:
            transfer, offer = self.offer if r < 0.75 else self.fetch
            cls = m.TierChunk if r < 0.75 else m.TierFetch
            fields = h.message(cls)
            if h.rng.random() < 0.8:  # its own copy and session: only the hostile fields differ
                fields.update(run=offer.run, checkpoint_dir=offer.checkpoint_dir, rank=0, session=transfer.session)
            if h.rng.random() < 0.5:
                fields["path"] = offer.files[0].path
            try:
                chunk = msgspec.convert(fields, cls)
            except (msgspec.ValidationError, TypeError):
                _send(self.data, [HEADER + msgspec.msgpack.encode(fields)])
            else:
                if cls is m.TierChunk:
                    sealer = TransferSealer(transfer, ASKER)
                    sealer._sent = h.rng.choice([0, 1, 2, 2**40]) if h.rng.random() < 0.5 else sealer._sent
                    _send(self.data, sealer.seal(chunk, h.raw()))
                else:
                    _send(self.data, [encode(chunk)])
        self._take_all()

    def _take_all(self) -> None:
        """Count the data socket's answers, and open each chunk: none may hold the canary's secret."""
        for frames in _recv_all(self.data):
            self._count(frames[0], TIER_REPLIES)
            if len(frames) > 1 and self.fetch is not None:
                try:
                    head = TIER_REPLIES.decode(frames[0])
                    if isinstance(head, m.TierChunk):
                        data = TransferSealer(self.fetch[0], ASKER).open(frames[0], head, frames[1])
                        if MARKER in data:
                            self.secrets_read += 1
                except Exception:  # noqa: BLE001 - an answer that does not open is counted as it came
                    pass

    def alive(self) -> str | None:
        problem = _tier_answers(self.probe, self.address)
        if self.offer is None or self.fetch is None:
            self.opened = 0
        if problem is not None or self.data is None:
            return problem
        _send(self.data, [encode(m.TierFetch(run="r", checkpoint_dir="c", rank=0, path="p", session=b"x" * 16))])
        if not self.data.poll(int(ANSWER_S * 1000)):
            return "the tier server's data socket did not answer a fetch of no transfer"
        self._take_all()
        return None

    def close(self) -> None:
        for sock in (self.control, self.probe, self.data):
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()


class ForkServerDoor(Door):
    """The fork server's pipe, as its agent writes it: `outlast.agent.forkserver.ForkServer`, a real process.
    Valid requests fork (a worker whose payload is not a pickle ends at once); paths in them are the agent's
    to choose, so hostile ones aim inside `root` only (the fork server does what its agent asks). Its reports
    are read by a thread of their own, as the agent's loop reads them while it writes."""

    name = "fork-server"

    def __init__(self, root: Path) -> None:
        super().__init__()
        from outlast.agent.forkserver import ForkServer

        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        # Its stderr a log of its own, as the agent's log is the fork server's: each frame it drops is a line.
        self.log_path = root / "fork-server.log"
        saved = os.dup(2)
        try:
            with open(self.log_path, "ab") as log:
                os.dup2(log.fileno(), 2)
            self.forks = ForkServer([], standby=False)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        deadline = time.monotonic() + 120
        while not self.forks.ready and time.monotonic() < deadline:
            if self.forks.active.conn.poll(1.0):
                self.forks.receive()
        self.n = 0
        self._lock = threading.Lock()
        self._probes_reaped: set[str] = set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _order(self, fields: dict) -> bytes:
        """A `ForkChild` frame with `fields`' hostile values and the agent's own paths (inside the root)."""
        self.n += 1
        base = dict(type="ForkChild", kind="worker", run_id="fuzz", attempt=0, rank=0, task_id="")
        base.update({k: v for k, v in fields.items() if k in ("kind", "run_id", "attempt", "rank", "task_id")})
        base.update(error_file=str(self.root / f"e{self.n}.json"), output_file=str(self.root / f"o{self.n}.log"),
                    cgroup_procs=[])
        return HEADER + msgspec.msgpack.encode(base)

    def _send(self, frame: bytes) -> None:
        """As the agent writes: a frame that is a `ForkChild` is followed by the fd of its child's request (a
        worker whose payload is not a pickle: it ends at once); any other frame goes alone."""
        from multiprocessing.reduction import send_handle

        from outlast.agent import fork_request

        try:
            order = TO_ZYGOTE.decode(frame)
        except BadMessage:
            order = None
        conn = self.forks.active.conn
        fd = -1
        if isinstance(order, m.ForkChild):  # its request first, as the agent makes it before it writes the order
            fd = fork_request.sealed(m.ForkWorker(
                run_id=order.run_id if order.run_id else "fuzz", attempt=0,
                spec=m.WorkerSpec(rank=0, local_rank=0, local_world_size=1, node_rank=0, world_size=1),
                controller_address="tcp://127.0.0.1:1", payload=b"not a pickle", env={}, cwd=str(self.root),
                sys_path=[], run_name="fuzz", restore_checkpoint=None, node_id="n", error_file=order.error_file))
        try:
            conn.send_bytes(frame)
            if fd >= 0:
                send_handle(conn, fd, self.forks.pid)
        except OSError:
            pass  # it died: `alive` says so
        finally:
            if fd >= 0:
                os.close(fd)

    def knock(self, h: Hostile) -> None:
        if h.rng.random() < 0.9:
            frame = h.frame([m.ForkChild])
            try:
                decoded = msgspec.msgpack.decode(frame[len(HEADER):]) if frame.startswith(HEADER) else None
            except msgspec.DecodeError:
                decoded = None
            if isinstance(decoded, dict) and decoded.get("type") == "ForkChild":
                frame = self._order(decoded)  # one that would fork: its hostile fields, the agent's paths
        else:
            frame = self._order(h.message(m.ForkChild))
        self._send(frame)

    def _read(self) -> None:
        conn = self.forks.active.conn
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError, ValueError, TypeError):  # ended, or closed under us by `close`
                return
            with self._lock:
                self._count(data, FROM_ZYGOTE)
                try:
                    msg = FROM_ZYGOTE.decode(data)
                except BadMessage:
                    continue
                if isinstance(msg, m.Reaped) and msg.run_id.startswith("probe-"):
                    self._probes_reaped.add(msg.run_id)

    def alive(self) -> str | None:
        proc = self.forks.active.proc if self.forks.active is not None else None  # standby=False: one it started
        if proc is None or proc.poll() is not None:
            return f"the fork server exited with {proc.returncode if proc else '?'}"
        probe = f"probe-{self.n}"
        self._send(self._order({"run_id": probe}))
        deadline = time.monotonic() + ANSWER_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"the fork server exited with {proc.returncode}"
            with self._lock:
                if probe in self._probes_reaped:
                    return None
            time.sleep(0.01)
        return f"the fork server did not fork and reap a valid request within {ANSWER_S:.0f} s"

    def close(self) -> None:
        self.forks.close()
        self._reader.join(timeout=10)
