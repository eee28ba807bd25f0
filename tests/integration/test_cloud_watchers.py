"""The cloud notice watchers over real HTTP, against local servers that answer as the clouds'
metadata endpoints are documented to: EC2 IMDSv2, the Compute Engine metadata server (with
hanging GETs), and Azure Scheduled Events."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from outlast.drain import (
    AwsWatcher,
    AzureWatcher,
    GcpWatcher,
    Notice,
    Watcher,
    detect_watchers,
)

pytestmark = pytest.mark.timeout(30)

FAST = {"poll_s": 0.05, "max_backoff_s": 0.1}


class FakeMetadataServer:
    """An HTTP server on 127.0.0.1 in a thread. `answer(method, path, query, headers)` returns
    (status, body, headers), or None to drop the connection without a word. With `fault` set,
    every request gets that instead: a status with a garbage body, or "drop"."""

    def __init__(self):
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.fault: int | str | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                fake._serve(self, "GET")

            def do_PUT(self):
                fake._serve(self, "PUT")

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def answer(self, method: str, path: str, query: dict[str, str], headers: dict[str, str]):
        raise NotImplementedError

    def count(self, path: str, method: str = "GET") -> int:
        return sum(1 for m, p, _ in list(self.requests) if m == method and p == path)

    def close(self):
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, handler: BaseHTTPRequestHandler, method: str):
        parts = urlsplit(handler.path)
        headers = {k.lower(): v for k, v in handler.headers.items()}
        self.requests.append((method, parts.path, headers))
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        fault = self.fault
        if fault == "drop":
            result = None
        elif fault is not None:
            result = (fault, "\x00garbage{{{", {})
        else:
            result = self.answer(method, parts.path, query, headers)
        if result is None:
            handler.close_connection = True
            return
        status, body, extra = result
        data = body.encode()
        handler.send_response(status)
        for name, value in {"Content-Type": "text/plain", **extra}.items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)


class FakeImds(FakeMetadataServer):
    """EC2 IMDSv2: tokens from PUT /latest/api/token, every GET must carry a live one (401 if not);
    spot/instance-action and events/recommendations/rebalance are 404 until set."""

    def __init__(self):
        self.tokens: dict[str, float] = {}
        self.interruption: dict | None = None
        self.rebalance: dict | None = None
        self.unauthorized = 0
        super().__init__()

    def expire_tokens(self):
        self.tokens.clear()

    def answer(self, method, path, query, headers):
        if method == "PUT":
            ttl = headers.get("x-aws-ec2-metadata-token-ttl-seconds", "")
            if path != "/latest/api/token" or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return 400, "Missing or Invalid Parameters", {}
            token = f"token-{len(self.tokens)}-{time.monotonic_ns()}"
            self.tokens[token] = time.monotonic() + int(ttl)
            return 200, token, {"X-aws-ec2-metadata-token-ttl-seconds": ttl}
        if self.tokens.get(headers.get("x-aws-ec2-metadata-token", ""), 0) <= time.monotonic():
            self.unauthorized += 1
            return 401, "", {}
        item = {"/latest/meta-data/spot/instance-action": self.interruption,
                "/latest/meta-data/events/recommendations/rebalance": self.rebalance}.get(path)
        return (404, "Not Found", {}) if item is None else (200, json.dumps(item), {})


class FakeGce(FakeMetadataServer):
    """Compute Engine's instance/preempted: FALSE, then TRUE; with an ETag per value, and
    `wait_for_change` held until the value moves past `last_etag` or `timeout_sec` runs out."""

    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self, *, etags: bool = True):
        self.value, self.version, self.etags = "FALSE", 0, etags
        self.changed = threading.Condition()
        self.held = 0
        super().__init__()

    def preempt(self):
        with self.changed:
            self.value, self.version = "TRUE", self.version + 1
            self.changed.notify_all()

    def etag(self) -> str:
        return f"{self.version:016x}"

    def answer(self, method, path, query, headers):
        if headers.get("metadata-flavor") != "Google":
            return 403, "Missing Metadata-Flavor:Google header.", {}
        if path != self.PATH:
            return 404, "", {}
        with self.changed:
            if query.get("wait_for_change") == "true":
                self.held += 1
                last, start = query.get("last_etag", self.etag()), self.etag()
                deadline = time.monotonic() + float(query.get("timeout_sec", 3600))
                while self.etag() == last and self.etag() == start and time.monotonic() < deadline:
                    self.changed.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            extra = {"Metadata-Flavor": "Google", **({"ETag": self.etag()} if self.etags else {})}
            return 200, self.value, extra


class FakeAzureImds(FakeMetadataServer):
    """Azure IMDS: compute/name, and scheduledevents with a DocumentIncarnation that goes up with
    every change; both need the header Metadata: true and an api-version."""

    def __init__(self, vm_name: str = "worker_3"):
        self.vm_name, self.incarnation, self.events = vm_name, 1, []
        super().__init__()

    def set_events(self, events: list[dict]):
        self.events, self.incarnation = events, self.incarnation + 1

    def answer(self, method, path, query, headers):
        if headers.get("metadata") != "true" or "api-version" not in query:
            return 400, '{"error": "Bad request"}', {}
        if path == "/metadata/instance/compute/name" and query.get("format") == "text":
            return 200, self.vm_name, {}
        if path == "/metadata/scheduledevents":
            doc = {"DocumentIncarnation": self.incarnation, "Events": self.events}
            return 200, json.dumps(doc), {"Content-Type": "application/json"}
        return 404, "", {}


def preempt_event(resources: list[str], not_before: str = "Mon, 19 Sep 2016 18:29:47 GMT") -> dict:
    return {"EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123", "EventStatus": "Scheduled",
            "EventType": "Preempt", "ResourceType": "VirtualMachine", "Resources": resources,
            "NotBefore": not_before, "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}


def wait_until(predicate: Callable[[], object], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


@pytest.fixture
def servers():
    made: list[FakeMetadataServer] = []

    def make(cls, **kwargs):
        made.append(cls(**kwargs))
        return made[-1]

    yield make
    for server in made:
        server.close()


@pytest.fixture
def watchers():
    started: list[Watcher] = []
    yield started.append
    for w in started:
        w.stop()


def start(watcher: Watcher, track) -> Watcher:
    track(watcher)
    return watcher.start()


def assert_single_notice_and_ended(got: list[Notice], watcher: Watcher) -> Notice:
    wait_until(lambda: got)
    wait_until(lambda: not watcher.is_alive())
    assert len(got) == 1 and watcher.notice == got[0]
    return got[0]


def utc(*args: int) -> float:
    return datetime(*args, tzinfo=timezone.utc).timestamp()


def test_aws_watcher_fires_once_when_an_interruption_is_scheduled(servers, watchers):
    imds, got = servers(FakeImds), []
    w = start(AwsWatcher(got.append, imds.url, **FAST), watchers)
    wait_until(lambda: imds.count("/latest/meta-data/spot/instance-action") >= 3)
    assert not got and w.is_alive()
    imds.interruption = {"action": "terminate", "time": "2026-09-18T08:22:00Z"}
    notice = assert_single_notice_and_ended(got, w)
    assert notice.source == "aws" and "terminate" in notice.reason
    assert notice.deadline_unix_s == utc(2026, 9, 18, 8, 22)
    assert imds.count("/latest/api/token", "PUT") == 1 and imds.unauthorized == 0


def test_aws_watcher_gets_a_new_token_when_the_old_one_is_refused(servers, watchers):
    imds, got = servers(FakeImds), []
    w = start(AwsWatcher(got.append, imds.url, **FAST), watchers)
    wait_until(lambda: imds.count("/latest/meta-data/spot/instance-action") >= 2)
    imds.expire_tokens()
    wait_until(lambda: imds.count("/latest/api/token", "PUT") >= 2)
    imds.interruption = {"action": "stop", "time": "2026-09-18T08:22:00Z"}
    assert assert_single_notice_and_ended(got, w).deadline_unix_s == utc(2026, 9, 18, 8, 22)
    assert imds.unauthorized >= 1


def test_aws_watcher_renews_its_token_before_it_lapses(servers, watchers):
    imds, got = servers(FakeImds), []
    start(AwsWatcher(got.append, imds.url, token_ttl_s=1, **FAST), watchers)
    wait_until(lambda: imds.count("/latest/api/token", "PUT") >= 2)
    assert imds.unauthorized == 0 and not got


def test_aws_watcher_reports_a_rebalance_recommendation_when_asked_to(servers, watchers):
    imds, got = servers(FakeImds), []
    w = start(AwsWatcher(got.append, imds.url, rebalance=True, **FAST), watchers)
    wait_until(lambda: imds.count("/latest/meta-data/events/recommendations/rebalance") >= 2)
    imds.rebalance = {"noticeTime": "2026-10-27T08:22:00Z"}
    notice = assert_single_notice_and_ended(got, w)
    assert notice.deadline_unix_s is None and "rebalanc" in notice.reason


def test_gcp_watcher_holds_a_get_on_the_etag_and_fires_when_preempted(servers, watchers):
    gce, got = servers(FakeGce), []
    w = start(GcpWatcher(got.append, gce.url, wait_s=10, **FAST), watchers)
    wait_until(lambda: gce.held >= 1)
    time.sleep(0.2)
    assert not got and gce.count(FakeGce.PATH) == 2  # one plain read, then one held GET
    before = time.time()
    gce.preempt()
    notice = assert_single_notice_and_ended(got, w)
    assert notice.source == "gcp" and before + 30 <= notice.deadline_unix_s <= time.time() + 30


def test_gcp_watcher_without_etags_polls_and_still_fires(servers, watchers):
    gce, got = servers(FakeGce, etags=False), []
    w = start(GcpWatcher(got.append, gce.url, notice_s=120, **FAST), watchers)
    wait_until(lambda: gce.count(FakeGce.PATH) >= 3)
    assert gce.held == 0
    gce.preempt()
    assert assert_single_notice_and_ended(got, w).deadline_unix_s > time.time() + 100


def test_azure_watcher_fires_on_a_preempt_for_this_vm_only(servers, watchers):
    imds, got = servers(FakeAzureImds, vm_name="worker_3"), []
    w = start(AzureWatcher(got.append, imds.url, **FAST), watchers)
    wait_until(lambda: imds.count("/metadata/scheduledevents") >= 2)
    imds.set_events([preempt_event(["worker_7"])])  # a neighbour in the scale set
    wait_until(lambda: imds.count("/metadata/scheduledevents") >= 5)
    assert not got
    imds.set_events([preempt_event(["worker_7", "worker_3"], "Tue, 20 Sep 2016 10:00:00 GMT")])
    notice = assert_single_notice_and_ended(got, w)
    assert notice.source == "azure" and notice.deadline_unix_s == utc(2016, 9, 20, 10)
    assert imds.count("/metadata/instance/compute/name") == 1


CLOUDS = {
    "aws": (FakeImds, AwsWatcher, lambda s: setattr(s, "interruption",
                                                    {"action": "terminate", "time": "2026-09-18T08:22:00Z"})),
    "gcp": (FakeGce, GcpWatcher, lambda s: s.preempt()),
    "azure": (FakeAzureImds, AzureWatcher, lambda s: s.set_events([preempt_event([s.vm_name])])),
}


@pytest.mark.parametrize("cloud", sorted(CLOUDS))
def test_errors_garbage_and_dropped_connections_do_not_stop_a_watcher(cloud, servers, watchers, caplog):
    fake_cls, watcher_cls, preempt = CLOUDS[cloud]
    server, got = servers(fake_cls), []
    caplog.set_level(logging.WARNING, logger="outlast.drain")
    # Faulty from the first request: a GCP watcher whose first read is answered holds its next GET for a
    # minute, and a fault set meanwhile reaches no request (seen on a loaded machine).
    server.fault = 500
    w = start(watcher_cls(got.append, server.url, **FAST), watchers)
    for fault in (500, 200, "drop"):  # a 500, a 200 with garbage, a connection closed unanswered
        server.fault, seen = fault, len(server.requests)
        wait_until(lambda seen=seen: len(server.requests) >= seen + 2)
    assert w.is_alive() and not got
    assert len([r for r in caplog.records if r.name == "outlast.drain"]) == 1  # once a minute at most
    server.fault = None
    preempt(server)
    assert assert_single_notice_and_ended(got, w).source == cloud


@pytest.mark.parametrize("cloud", sorted(CLOUDS))
def test_a_dead_metadata_server_is_retried_quietly_and_stop_ends_the_watcher(cloud, watchers, caplog):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    caplog.set_level(logging.WARNING, logger="outlast.drain")
    got: list[Notice] = []
    w = start(CLOUDS[cloud][1](got.append, url, **FAST), watchers)
    time.sleep(0.3)
    assert w.is_alive() and not got
    assert len([r for r in caplog.records if r.name == "outlast.drain"]) == 1
    w.stop()
    assert not w.is_alive()


def test_stop_cuts_a_held_gcp_request_short(servers, watchers):
    gce = servers(FakeGce)
    w = start(GcpWatcher(lambda n: None, gce.url, wait_s=30, **FAST), watchers)
    wait_until(lambda: gce.held >= 1)
    w.stop()
    assert not w.is_alive()  # stop waits 5 s for the thread: the 30 s the server holds the request was cut short


def test_a_failing_callback_is_logged_and_the_watcher_still_ends(servers, watchers, caplog):
    gce = servers(FakeGce)
    gce.preempt()

    def broken(notice: Notice) -> None:
        raise RuntimeError("the agent could not drain")

    w = start(GcpWatcher(broken, gce.url, **FAST), watchers)
    wait_until(lambda: not w.is_alive())
    assert w.notice is not None and "on_notice failed" in caplog.text


def test_detect_watchers_builds_the_ones_opted_into_and_each_fires(servers, watchers):
    fakes = {cloud: servers(CLOUDS[cloud][0]) for cloud in CLOUDS}
    got: list[Notice] = []
    built = detect_watchers(["gcp", "AWS", "azure", "gcp"], got.append,
                            base_urls={cloud: fake.url for cloud, fake in fakes.items()})
    assert [type(w) for w in built] == [GcpWatcher, AwsWatcher, AzureWatcher]
    for cloud, fake in fakes.items():  # before the start: with the clouds' poll intervals, the first ask sees it
        CLOUDS[cloud][2](fake)
    for w in built:
        start(w, watchers)
    wait_until(lambda: len(got) == 3)
    assert sorted(n.source for n in got) == ["aws", "azure", "gcp"]


def test_detect_watchers_names_the_choices_for_an_unknown_cloud():
    with pytest.raises(ValueError, match="aws, gcp, azure"):
        detect_watchers(["aws", "oracle"], lambda n: None)
