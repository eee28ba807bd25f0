import msgspec
import pytest

from outlast.protocol import messages as m
from outlast.protocol.transport import (AGENT_EVENTS, AGENT_REQUESTS, HEADER, TO_WORKER, WORKER_MESSAGES,
                                        BadMessage, Codec, encode)


class Scalar:
    """Like a numpy or torch scalar: `.item()` gives the Python value."""

    def __init__(self, value):
        self.value = value

    def item(self):
        return self.value


class Array:
    """Like a numpy array of several values: `.item()` refuses, `.tolist()` works."""

    def item(self):
        raise ValueError("can only convert an array of size 1")

    def tolist(self):
        return [1.0, 2.0]


def report(**metrics) -> m.Report:
    return m.Report(attempt=1, rank=0, index=0, metrics=metrics)


@pytest.mark.parametrize(("codec", "msg"), [
    (WORKER_MESSAGES, m.Report(attempt=2, rank=1, index=3, metrics={"loss": 0.5}, checkpoint_dir="c",
                               files=[m.FileEntry("a", 1, "f" * 64)])),
    (WORKER_MESSAGES, m.CollectiveRequest(attempt=1, rank=0, seq=4, op="broadcast", payload=b"\x00\xff")),
    (AGENT_REQUESTS, m.StopWorkers(run_id="r", attempt=1, grace_s=2.5)),
    (AGENT_EVENTS, m.WorkerExited(run_id="r", attempt=1, rank=0, pid=5, exit_code=None, signal=9,
                                  error=m.WorkerError(exc_type="E", message="m", traceback="t", phase="train"),
                                  node_id="n")),
    (TO_WORKER, m.CollectiveTimeout(seq=1, op="barrier", missing_ranks=[2], waited_s=3.0)),
], ids=lambda x: type(x).__name__)
def test_a_message_decodes_back_to_an_equal_message_of_its_type(codec, msg):
    decoded = codec.decode(encode(msg))
    assert type(decoded) is type(msg) and decoded == msg


def test_metrics_with_scalar_objects_are_sent_as_their_python_values():
    decoded = WORKER_MESSAGES.decode(encode(report(loss=Scalar(0.25), step=Scalar(7), nested={"a": [Scalar(1)]})))
    assert decoded.metrics == {"loss": 0.25, "step": 7, "nested": {"a": [1]}}
    assert type(decoded.metrics["step"]) is int


def test_metrics_whose_item_refuses_are_sent_as_lists():
    assert WORKER_MESSAGES.decode(encode(report(hist=Array()))).metrics == {"hist": [1.0, 2.0]}


def test_a_metric_that_cannot_be_sent_raises_type_error_naming_its_type():
    class Opaque:
        pass

    with pytest.raises(TypeError, match="cannot send a value of type Opaque"):
        encode(report(x=Opaque()))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"garbage that is not msgpack", encode(m.Ping())[:-1]])
def test_malformed_bytes_raise_bad_message(data):
    with pytest.raises(BadMessage):
        WORKER_MESSAGES.decode(data)


def test_a_well_formed_message_of_another_union_raises_bad_message():
    with pytest.raises(BadMessage, match="Ping"):
        WORKER_MESSAGES.decode(encode(m.Ping()))


def test_a_message_missing_a_field_raises_bad_message_naming_the_field():
    codec = Codec(m.WorkerHello)
    with pytest.raises(BadMessage, match="pid"):
        codec.decode(HEADER + msgspec.msgpack.encode({"type": "WorkerHello", "attempt": 1, "rank": 0}))


def test_bad_message_is_a_value_error():
    assert issubclass(BadMessage, ValueError)


def test_a_message_of_another_protocol_version_is_refused_naming_both_versions():
    from outlast.protocol.transport import MAGIC, VersionMismatch

    newer = MAGIC + bytes([m.PROTOCOL_VERSION + 1]) + encode(m.Ping())[len(HEADER):]
    for codec in (AGENT_REQUESTS, AGENT_EVENTS, WORKER_MESSAGES, TO_WORKER):
        with pytest.raises(VersionMismatch, match=f"protocol version {m.PROTOCOL_VERSION + 1} and this process "
                                                  f"version {m.PROTOCOL_VERSION}"):
            codec.decode(newer)
    # A frame of an outlast before the header (protocol 1): refused as malformed, saying so.
    with pytest.raises(BadMessage, match="no outlast protocol header"):
        AGENT_REQUESTS.decode(encode(m.Ping())[len(HEADER):])
