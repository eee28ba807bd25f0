"""Watchers that ask the metadata servers for preemption notices and carry out the decisions
of `outlast.drain.cloud`, one request at a time, until a notice arrives or the caller stops them."""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypedDict
from urllib.parse import urlsplit

from outlast.drain.cloud import (
    AWS_ACTION_PATH,
    AWS_REBALANCE_PATH,
    AWS_TOKEN_PATH,
    AZURE_EVENTS_PATH,
    AZURE_NAME_PATH,
    DEFAULT_BASE_URLS,
    SOURCES,
    HttpAnswer,
    Notice,
    PollStep,
    backoff_s,
    decide_aws_action,
    decide_aws_rebalance,
    decide_aws_token,
    decide_azure,
    decide_gcp,
    gcp_query,
    parse_azure_vm_name,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

log = logging.getLogger("outlast.drain")

# A link-local metadata server accepts a connection in milliseconds; waiting longer only delays
# stop(), which cannot cut a connect short.
CONNECT_TIMEOUT_S = 2.0


class _Http:
    """One request at a time over http.client: no proxy from the environment (a metadata server
    is reached directly, and Azure's refuses proxied requests), and `abort()` ends a held GET."""

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        self._host, self._port, self._prefix = parts.hostname or "", parts.port or 80, parts.path.rstrip("/")
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = False

    def request(self, method: str, path: str, headers: Mapping[str, str], timeout_s: float) -> HttpAnswer:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=min(timeout_s, CONNECT_TIMEOUT_S))
        try:
            conn.connect()
            conn.sock.settimeout(timeout_s)
            with self._lock:  # abort() either sees this connection or we see the abort
                if self._aborted:
                    raise ConnectionAbortedError("the watcher was stopped")
                self._conn = conn
            conn.request(method, self._prefix + path, headers=dict(headers))
            resp = conn.getresponse()
            body = resp.read(65536).decode("utf-8", "replace")
            return HttpAnswer(resp.status, body, {k.lower(): v for k, v in resp.getheaders()})
        finally:
            with self._lock:
                self._conn = None
            conn.close()

    def abort(self) -> None:
        with self._lock:
            self._aborted, conn = True, self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns at once
            except OSError:
                pass


class WatcherOptions(TypedDict, total=False):
    """What every watcher takes besides its cloud's own settings: `Watcher`'s keyword arguments."""

    max_backoff_s: float | None
    log_every_s: float
    clock: Callable[[], float]


class Watcher:
    """Asks one cloud's metadata server until it announces a preemption, then calls `on_notice`
    once and ends. Never raises: an unreachable server or an unusable answer is logged at most
    once per `log_every_s` and retried, backing off up to `max_backoff_s`."""

    source = ""

    def __init__(self, on_notice: Callable[[Notice], None], base_url: str, *, poll_s: float,
                 request_timeout_s: float, max_backoff_s: float | None = None, log_every_s: float = 60.0,
                 clock: Callable[[], float] = time.time):
        self.base_url, self.poll_s = base_url, poll_s
        self.notice: Notice | None = None
        self._on_notice, self._timeout_s, self._clock = on_notice, request_timeout_s, clock
        self._max_backoff_s = 4 * poll_s if max_backoff_s is None else max_backoff_s
        self._log_every_s = log_every_s
        self._last_log: float | None = None
        self._http, self._stop = _Http(base_url), threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watcher:
        self._thread = threading.Thread(target=self.run, name=f"outlast-{self.source}-notices", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._http.abort()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self) -> Notice | None:
        """The loop, in the calling thread; returns the notice, or None once stopped."""
        failures = 0
        while not self._stop.is_set():
            try:
                step = self._poll()
            # Unreachable, reset, timed out, not HTTP, or a malformed chunk (ValueError): try again.
            except (OSError, http.client.HTTPException, ValueError) as e:
                step = PollStep(problem=f"{self.source} metadata server at {self.base_url} could not be read: "
                                        f"{type(e).__name__}: {e}", retry_after_s=self.poll_s)
            if step.notice is not None:
                return self._deliver(step.notice)
            if step.problem is not None:
                failures += 1
                self._warn(step.problem, failures)
            elif failures:
                log.info("%s metadata server answers again after %d failed requests", self.source, failures)
                failures = 0
            self._stop.wait(backoff_s(step.retry_after_s, failures, self._max_backoff_s)
                            if step.problem else step.retry_after_s)
        return None

    def _deliver(self, notice: Notice) -> Notice | None:
        if self._stop.is_set():
            return None
        self.notice = notice
        log.warning("cloud notice: %s (deadline %s)", notice.reason, notice.deadline_unix_s)
        try:
            self._on_notice(notice)
        except Exception:  # the caller's bug must not look like a metadata problem, nor kill silently
            log.exception("on_notice failed for %s", notice.reason)
        return notice

    def _warn(self, problem: str, failures: int) -> None:
        now = self._clock()
        if self._last_log is None or now - self._last_log >= self._log_every_s:
            self._last_log = now
            log.warning("%s (%d failed requests in a row; still trying)", problem, failures)

    def _poll(self) -> PollStep:
        raise NotImplementedError


class AwsWatcher(Watcher):
    """EC2 spot interruption notices through IMDSv2; with `rebalance`, rebalance recommendations too."""

    source = "aws"

    def __init__(self, on_notice: Callable[[Notice], None], base_url: str = DEFAULT_BASE_URLS["aws"], *,
                 poll_s: float = 5.0, request_timeout_s: float = 2.0, token_ttl_s: int = 21600,
                 rebalance: bool = False, **kwargs: Unpack[WatcherOptions]) -> None:
        super().__init__(on_notice, base_url, poll_s=poll_s, request_timeout_s=request_timeout_s, **kwargs)
        self._token_ttl_s, self._rebalance = token_ttl_s, rebalance
        self._token: str | None = None
        self._token_renew_at = 0.0

    def _poll(self) -> PollStep:
        fresh = False
        if self._token is None or self._clock() >= self._token_renew_at:
            ans = self._http.request("PUT", AWS_TOKEN_PATH, {"X-aws-ec2-metadata-token-ttl-seconds":
                                                             str(self._token_ttl_s)}, self._timeout_s)
            step = decide_aws_token(ans, self.poll_s)
            if step.token is None:
                return step
            # Renewed before it lapses, so a GET rarely meets a 401; a 401 is handled all the same.
            self._token, self._token_renew_at, fresh = step.token, self._clock() + 0.9 * self._token_ttl_s, True
        token = self._token
        items = [(AWS_ACTION_PATH, decide_aws_action)]
        if self._rebalance:
            items.append((AWS_REBALANCE_PATH, decide_aws_rebalance))
        step = PollStep(retry_after_s=self.poll_s)
        for path, decide in items:
            ans = self._http.request("GET", path, {"X-aws-ec2-metadata-token": token}, self._timeout_s)
            step = decide(ans, self.poll_s, fresh)
            if step.refresh_token:
                self._token = None
            if step.notice is not None or step.problem is not None or step.refresh_token:
                return step
        return step


class GcpWatcher(Watcher):
    """Compute Engine's `preempted` value, with hanging GETs. `notice_s` is the time left after
    TRUE: 30 s for a Spot VM, plus any preemptionNoticeDuration the VM was created with."""

    source = "gcp"

    def __init__(self, on_notice: Callable[[Notice], None], base_url: str = DEFAULT_BASE_URLS["gcp"], *,
                 notice_s: float = 30.0, wait_s: int = 60, poll_s: float = 1.0, request_timeout_s: float = 5.0,
                 **kwargs: Unpack[WatcherOptions]) -> None:
        super().__init__(on_notice, base_url, poll_s=poll_s, request_timeout_s=request_timeout_s, **kwargs)
        self._notice_s, self._wait_s = notice_s, wait_s
        self._etag: str | None = None

    def _poll(self) -> PollStep:
        timeout_s = self._timeout_s + (self._wait_s if self._etag else 0)  # outlast the held GET
        ans = self._http.request("GET", gcp_query(self._etag, self._wait_s), {"Metadata-Flavor": "Google"}, timeout_s)
        step = decide_gcp(ans, self._clock(), self._notice_s, self.poll_s)
        self._etag = step.etag
        return step


class AzureWatcher(Watcher):
    """Azure Scheduled Events of `event_types` ("Terminate" too, for scale-set deletions) that
    name this VM; the name comes from the instance metadata unless `vm_name` is given."""

    source = "azure"

    def __init__(self, on_notice: Callable[[Notice], None], base_url: str = DEFAULT_BASE_URLS["azure"], *,
                 vm_name: str | None = None, event_types: Sequence[str] = ("Preempt",), poll_s: float = 1.0,
                 request_timeout_s: float = 130.0, **kwargs: Unpack[WatcherOptions]) -> None:
        # The long timeout: the service switches on at the first request, which can take two minutes.
        super().__init__(on_notice, base_url, poll_s=poll_s, request_timeout_s=request_timeout_s, **kwargs)
        self._vm_name, self._event_types = vm_name, tuple(event_types)

    def _poll(self) -> PollStep:
        headers = {"Metadata": "true"}
        if self._vm_name is None:
            ans = self._http.request("GET", AZURE_NAME_PATH, headers, min(self._timeout_s, 5.0))
            self._vm_name = parse_azure_vm_name(ans)
        ans = self._http.request("GET", AZURE_EVENTS_PATH, headers, self._timeout_s)
        return decide_azure(ans, self._clock(), self._vm_name, self._event_types, self.poll_s)


def detect_watchers(kinds: Sequence[str], on_notice: Callable[[Notice], None], *,
                    base_urls: Mapping[str, str] | None = None) -> list[Watcher]:
    """The watchers the user opted into by name ("aws", "gcp", "azure"), not yet started."""
    names = list(dict.fromkeys(k.strip().lower() for k in kinds))
    unknown = [k for k in names if k not in SOURCES]
    if unknown:
        raise ValueError(f"unknown cloud notice source {', '.join(map(repr, unknown))}: "
                         f"choose among {', '.join(SOURCES)}")
    classes: dict[str, Callable[[Callable[[Notice], None], str], Watcher]] = {
        "aws": AwsWatcher, "gcp": GcpWatcher, "azure": AzureWatcher}
    urls = {**DEFAULT_BASE_URLS, **(base_urls or {})}
    return [classes[k](on_notice, urls[k]) for k in names]
