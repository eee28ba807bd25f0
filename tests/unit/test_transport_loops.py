"""The transport's one receive loop and one bounded send, on real ZeroMQ sockets over inproc and ipc."""

from __future__ import annotations

import logging

import pytest
import zmq

from outlast.protocol import messages as m
from outlast.protocol.transport import (AGENT_REQUESTS, HEADER, MAGIC, BadMessage, VersionMismatch, encode, receive_all,
                                        send_or_drop)


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


@pytest.fixture(params=["inproc", "ipc"])
def pair(request, ctx, tmp_path):
    """A ROUTER and a DEALER connected to it, over each transport."""
    address = "inproc://loops" if request.param == "inproc" else f"ipc://{tmp_path}/loops.sock"
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind(address)
    dealer.setsockopt(zmq.IDENTITY, b"dealer-1")
    dealer.connect(address)
    yield router, dealer
    dealer.close(linger=0)
    router.close(linger=0)


def arrived(sock: zmq.Socket) -> None:
    """Wait until a message is queued on `sock` (ipc delivers through the I/O thread, maybe in more than one batch)."""
    assert sock.poll(10_000, zmq.POLLIN)


def sent(dealer: zmq.Socket, *frames: bytes) -> None:
    for frame in frames:
        dealer.send(frame)


def test_receive_all_takes_every_waiting_message_in_order_then_returns_without_waiting(pair):
    router, dealer = pair
    msgs = [m.StopWorkers(run_id="r", attempt=i, grace_s=1.0) for i in range(5)]
    sent(dealer, *(encode(x) for x in msgs))
    got: list = []
    while len(got) < len(msgs):
        arrived(router)
        got += list(receive_all(router, AGENT_REQUESTS, "request"))
    assert [frames for frames, _ in got] == [[b"dealer-1", encode(x)] for x in msgs]
    assert [msg for _, msg in got] == msgs
    assert list(receive_all(router, AGENT_REQUESTS, "request")) == []  # nothing left: it returns at once


def test_a_malformed_message_is_logged_and_dropped_and_the_rest_still_come(pair, caplog):
    router, dealer = pair
    good = m.StopWorkers(run_id="r", attempt=1, grace_s=1.0)
    sent(dealer, b"not outlast", HEADER + b"\xc1", encode(good))
    got: list = []
    with caplog.at_level(logging.WARNING, logger="outlast.protocol"):
        while not got:
            arrived(router)
            got += [msg for _, msg in receive_all(router, AGENT_REQUESTS, "request from a test")]
    assert got == [good]
    dropped = [r.getMessage() for r in caplog.records if "dropped a malformed request from a test" in r.getMessage()]
    assert len(dropped) == 2 and "no outlast protocol header" in dropped[0], dropped


def test_a_malformed_message_the_caller_takes_is_not_logged_as_dropped(pair, caplog):
    router, dealer = pair
    other_version = MAGIC + bytes([m.PROTOCOL_VERSION + 1]) + b"\x80"
    sent(dealer, other_version, b"garbage")
    taken: list[tuple[bytes, type]] = []

    def take_version_mismatch(frames: list[bytes], e: BadMessage) -> bool:
        if isinstance(e, VersionMismatch):
            taken.append((frames[0], type(e)))
            return True
        return False

    seen = 0
    with caplog.at_level(logging.WARNING, logger="outlast.protocol"):
        while seen < 2:
            arrived(router)
            assert list(receive_all(router, AGENT_REQUESTS, "request", on_bad=take_version_mismatch)) == []
            seen = len(taken) + sum("dropped a malformed request" in r.getMessage() for r in caplog.records)
    assert taken == [(b"dealer-1", VersionMismatch)]
    dropped = [r.getMessage() for r in caplog.records if "dropped a malformed request" in r.getMessage()]
    assert len(dropped) == 1 and "no outlast protocol header" in dropped[0], dropped


def test_send_or_drop_sends_what_the_queue_takes_and_drops_the_rest_without_waiting(ctx, tmp_path):
    address = f"ipc://{tmp_path}/full.sock"  # nobody reads yet: the queue fills
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, 3)
    dealer.connect(address)
    try:
        results = [send_or_drop(dealer, m.StopWorkers(run_id="r", attempt=i, grace_s=1.0)) for i in range(50)]
        accepted = results.index(False)
        assert 0 < accepted and not any(results[accepted:]), results  # once full, every later one is dropped
        router = ctx.socket(zmq.ROUTER)
        router.bind(address)
        try:
            got = []
            while len(got) < accepted:
                assert router.poll(10_000)
                got.append(AGENT_REQUESTS.decode(router.recv_multipart()[-1]).attempt)
            assert got == list(range(accepted))  # what was taken arrives, in order; what was dropped never does
            assert not router.poll(200)
        finally:
            router.close(linger=0)
    finally:
        dealer.close(linger=0)


def test_send_or_drop_to_no_peer_at_all_drops_at_once(ctx, tmp_path):
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IMMEDIATE, 1)  # no queue for a peer not connected: the head gone, say
    dealer.connect(f"ipc://{tmp_path}/nobody.sock")
    try:
        assert send_or_drop(dealer, m.StopWorkers(run_id="r", attempt=1, grace_s=1.0)) is False
    finally:
        dealer.close(linger=0)


def test_send_or_drop_over_inproc_reaches_its_peer(ctx):
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://bounded")
    dealer.connect("inproc://bounded")
    try:
        assert send_or_drop(dealer, m.StopWorkers(run_id="r", attempt=7, grace_s=1.0))
        assert router.poll(10_000)
        assert AGENT_REQUESTS.decode(router.recv_multipart()[-1]).attempt == 7
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
