"""Encoding of wire messages and the few ZeroMQ socket shapes outlast uses.

ZeroMQ does the framing and reconnection; this module only picks socket options
(no linger surprises, bounded reconnect backoff) and decodes into typed messages.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec
import zmq

from outlast.protocol import messages as m

if TYPE_CHECKING:
    from outlast.protocol.auth import ClusterKey

log = logging.getLogger("outlast.protocol")

T = TypeVar("T")


def _enc_hook(obj: Any) -> Any:
    # Metrics often hold numpy or torch scalars; send their Python value.
    item = getattr(obj, "item", None)
    if callable(item):
        try:
            return item()
        except (ValueError, RuntimeError):
            pass
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(
        f"cannot send a value of type {type(obj).__name__}: metrics must be numbers, strings, "
        "booleans, None, or lists and dicts of them"
    )


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

# Every frame on every channel starts with these bytes and the sender's protocol version, so
# that a peer of another outlast is refused, saying both versions, before its message is read
# as one of ours (a field that changed meaning would otherwise be misread without a word).
MAGIC = b"OLP"
HEADER = MAGIC + bytes([m.PROTOCOL_VERSION])


def encode(msg: m.Msg) -> bytes:
    return HEADER + _encoder.encode(msg)


class BadMessage(ValueError):
    """A message that does not decode to any expected type; logged and dropped."""


class VersionMismatch(BadMessage):
    """A message from an outlast that speaks another protocol version."""

    def __init__(self, theirs: int) -> None:
        self.theirs = theirs
        super().__init__(f"a peer speaks outlast protocol version {theirs} and this process version "
                         f"{m.PROTOCOL_VERSION}: run the same outlast release on every node, driver and tool "
                         f"of the cluster (pip show outlast)")


class Codec(Generic[T]):
    """Decodes one union of message types; a malformed message raises `BadMessage`, one of another
    protocol version `VersionMismatch`."""

    def __init__(self, union: Any) -> None:
        # `union` is a Union of structs, which no type expression of a parameter can be bound to T by
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)

    def decode(self, data: bytes) -> T:
        if data[:len(MAGIC)] != MAGIC or len(data) <= len(MAGIC):
            raise BadMessage(f"no outlast protocol header (outlast before protocol version 2 sent none; this "
                             f"process speaks version {m.PROTOCOL_VERSION})")
        if data[len(MAGIC)] != m.PROTOCOL_VERSION:
            raise VersionMismatch(data[len(MAGIC)])
        try:
            return self._decoder.decode(memoryview(data)[len(HEADER):])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise BadMessage(str(e)) from None


AGENT_REQUESTS: Codec[m.AgentRequest] = Codec(m.AgentRequest)
AGENT_EVENTS: Codec[m.AgentEvent] = Codec(m.AgentEvent)
WORKER_MESSAGES: Codec[m.WorkerMessage] = Codec(m.WorkerMessage)
TO_WORKER: Codec[m.ControllerToWorker] = Codec(m.ControllerToWorker)
TO_ZYGOTE: Codec[m.ToZygote] = Codec(m.ToZygote)
TO_CHILD: Codec[m.ToChild] = Codec(m.ToChild)
FROM_ZYGOTE: Codec[m.FromZygote] = Codec(m.FromZygote)
HEAD_TO_MEMBER: Codec[m.HeadToMember] = Codec(m.HeadToMember)
TIER_REQUESTS: Codec[m.TierRequest] = Codec(m.TierRequest)
TIER_REPLIES: Codec[m.TierReply] = Codec(m.TierReply)


def receive_all(sock: zmq.Socket[bytes], codec: Codec[T], what: str,
                on_bad: Callable[[list[bytes], BadMessage], bool] | None = None) -> Iterator[tuple[list[bytes], T]]:
    """Every message waiting on `sock`, as (its frames, the last one decoded), until none is left: it never waits.
    A message that does not decode is dropped, and the log says "dropped a malformed {what}" and why, unless
    `on_bad` (given its frames and the error) takes it and returns True (a refusal sent back, say)."""
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            msg = codec.decode(frames[-1])
        except BadMessage as e:
            if on_bad is None or not on_bad(frames, e):
                log.warning("dropped a malformed %s: %s", what, e)
            continue
        yield frames, msg


def send_or_drop(sock: zmq.Socket[bytes], msg: m.Msg) -> bool:
    """Send `msg` without waiting. Where the socket's queue is full (past its high-water mark: its peer gone, or
    that far behind), the message is dropped, nothing is logged, and False is returned: a peer that went away must
    never block the sender's loop. The caller says why losing the message is safe (a heartbeat sent again on a
    later turn, say)."""
    try:
        sock.send(encode(msg), zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def tune(sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
    sock.setsockopt(zmq.LINGER, 2000)  # flush pending sends on close, but never hang forever
    sock.setsockopt(zmq.RECONNECT_IVL, 20)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
    return sock


def bind_router(ctx: zmq.Context[zmq.Socket[bytes]], host: str = "127.0.0.1", port: int = 0,
                key: "ClusterKey | None" = None, max_frame: int = -1) -> tuple[zmq.Socket[bytes], str]:
    """With a cluster key the socket only talks to peers holding it (the context needs
    `auth.start_authenticator`). `max_frame`: a peer that sends a larger frame is disconnected (-1: any size)."""
    sock = tune(ctx.socket(zmq.ROUTER))
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a peer that went away must not raise on send
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    if key is not None:
        key.serve(sock)
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        sock.bind(f"tcp://{host}:*")
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return sock, address


def connect_dealer(ctx: zmq.Context[zmq.Socket[bytes]], address: str, identity: bytes | None = None,
                   key: "ClusterKey | None" = None) -> zmq.Socket[bytes]:
    sock = tune(ctx.socket(zmq.DEALER))
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if key is not None:
        key.connect_as_client(sock)
    sock.connect(address)
    return sock


INCARNATION_VAR = "OUTLAST_LIVE_INCARNATION"  # a live recovery's replacement: how many processes held its rank before
LIVE_STORE_VAR = "OUTLAST_LIVE_STORE"  # in every rank of a live-recovery run: its live group's store, "host:port"
# A rank forked into a live group that a shrink numbered afresh: "rank/world", its rank and the world's size there
# (get_context()'s), where the rank it was spawned as stays its name to the controller.
LIVE_GROUP_RANK_VAR = "OUTLAST_LIVE_GROUP_RANK"


def incarnation_from_env() -> int:
    return int(os.environ.get(INCARNATION_VAR, "0") or 0)


def live_group_rank_from_env() -> tuple[int, int] | None:
    """(rank, world) of `LIVE_GROUP_RANK_VAR`, or None when it is not set."""
    text = os.environ.get(LIVE_GROUP_RANK_VAR, "")
    if not text:
        return None
    rank, _, world = text.partition("/")
    try:
        r, w = int(rank), int(world)
    except ValueError:
        raise ValueError(f"{LIVE_GROUP_RANK_VAR}={text!r} is not 'rank/world'") from None
    if not 0 <= r < w:
        raise ValueError(f"{LIVE_GROUP_RANK_VAR}={text!r}: the rank is not below the world size")
    return r, w


def worker_identity(attempt: int, rank: int, incarnation: int = 0) -> bytes:
    """"attempt:rank"; a live recovery's replacement adds ":i{incarnation}", since the process it replaces may
    still be connected (a drained rank, moving): a ROUTER drops a second peer that takes an identity in use."""
    return f"{attempt}:{rank}".encode() + (f":i{incarnation}".encode() if incarnation else b"")


def watch_identity(attempt: int, rank: int, incarnation: int = 0) -> bytes:
    """A rank's watch thread has its own socket (a ZeroMQ socket belongs to one thread), beside its worker's."""
    return worker_identity(attempt, rank, incarnation) + b":watch"


def incarnation_of(identity: bytes) -> int:
    """Which process of its rank a worker's socket belongs to (`worker_identity`): 0 unless it says."""
    parts = identity.split(b":")
    if len(parts) > 2 and parts[2][:1] == b"i" and parts[2][1:].isdigit():
        return int(parts[2][1:])
    return 0


def route_ip(address: str | None) -> str:
    """The local address that packets to `address` (tcp://host:port or host:port) leave from: where a
    peer there reaches us. Without an address, the default route's; loopback when there is no route."""
    import socket

    host = address.split("://", 1)[-1].rsplit(":", 1)[0] if address else "192.0.2.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: this only asks the routing table
            ip: str = s.getsockname()[0]  # (host, port) of an AF_INET socket
            return ip
    except OSError:
        return "127.0.0.1"
