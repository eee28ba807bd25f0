"""The clouds' preemption notices, decided: one metadata answer in, one `PollStep` out.

Each `decide_*` turns an answer (status, body, headers) into a `Notice`, or into how to go on
(wait, get a new token). No I/O and no clock here: `cloud_watchers` asks the metadata servers and
carries the steps out. What the clouds document, and what this relies on:

- AWS: PUT /latest/api/token gives an IMDSv2 token; GET /latest/meta-data/spot/instance-action is
  404 until EC2 schedules an interruption, then {"action": "terminate"|"stop"|"hibernate",
  "time": "...Z"}, about two minutes ahead. 401 means the token is no longer valid: get a new one.
  AWS recommends checking every 5 s.
- GCP: GET /computeMetadata/v1/instance/preempted (header Metadata-Flavor: Google) answers FALSE,
  then TRUE once the VM is preempted; a Spot VM then has 30 s before it is powered off.
  `wait_for_change=true&last_etag=E&timeout_sec=N` holds the request until the value moves on.
- Azure: GET /metadata/scheduledevents?api-version=2020-07-01 (header Metadata: true) lists events;
  "Preempt" is a Spot eviction, at least 30 s ahead, never before NotBefore (blank once started).
  Events reach every VM of a scale set; `Resources` names the ones hit. Azure suggests polling 1/s.
"""

from __future__ import annotations

import email.utils
import json
import re
from collections.abc import Sequence
from datetime import datetime, timezone
from urllib.parse import urlencode

import msgspec

SOURCES = ("aws", "gcp", "azure")
DEFAULT_BASE_URLS = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal",
                     "azure": "http://169.254.169.254"}
AWS_TOKEN_PATH = "/latest/api/token"
AWS_ACTION_PATH = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
AZURE_EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
AZURE_NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
_AWS_ACTIONS = ("terminate", "stop", "hibernate")
_VM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")  # Azure allows letters, digits, "-", "_", "."


class Notice(msgspec.Struct, frozen=True):
    """A cloud announced that this machine goes away: drain it by `deadline_unix_s`."""

    source: str  # "aws", "gcp" or "azure"
    reason: str  # one readable line, for the log and the run's history
    deadline_unix_s: float | None  # None: the cloud gave no date (an AWS rebalance recommendation)
    detail: str  # the metadata server's answer, cut to 500 characters


class PollStep(msgspec.Struct, frozen=True, kw_only=True):
    """What one metadata answer means: a notice, or how to go on."""

    notice: Notice | None = None
    retry_after_s: float = 0.0
    problem: str | None = None  # an answer we can't use: logged, then retried with back-off
    refresh_token: bool = False  # AWS: the token was refused; get a new one before the next GET
    token: str | None = None  # AWS: a new token
    etag: str | None = None  # GCP: the value's version, which the next (hanging) GET waits past


class HttpAnswer(msgspec.Struct, frozen=True):
    status: int
    body: str
    headers: dict[str, str]  # names in lower case


def backoff_s(poll_s: float, failures: int, cap_s: float) -> float:
    """The wait after `failures` problems in a row: doubling from `poll_s`, never past `cap_s`."""
    if failures <= 1:
        return poll_s
    return min(max(cap_s, poll_s), poll_s * 2.0 ** min(failures - 1, 30))


def _unexpected(source: str, what: str, ans: HttpAnswer, retry_after_s: float) -> PollStep:
    return PollStep(problem=f"{source} metadata server answered {what} with HTTP {ans.status}: {ans.body[:200]!r}",
                    retry_after_s=retry_after_s)


def _json_object(text: str) -> dict[str, object] | None:
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _parse_iso_utc(value: object) -> float | None:
    if not isinstance(value, str):
        return None
    try:  # Python 3.10 reads no "Z"; the documents say the time is in UTC
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


def _parse_http_date(value: str) -> float | None:
    try:  # "Mon, 19 Sep 2016 18:29:47 GMT"
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


# ---- AWS ----------------------------------------------------------------------------------


def decide_aws_token(ans: HttpAnswer, poll_s: float) -> PollStep:
    """The answer to PUT /latest/api/token (403: IMDS is turned off for the instance)."""
    token = ans.body.strip()
    if ans.status == 200 and token and token.isascii() and token.isprintable():
        return PollStep(token=token)  # checked: it goes into a header, where a newline would not fit
    return _unexpected("aws", "the IMDSv2 token request", ans, poll_s)


def _aws_status(ans: HttpAnswer, poll_s: float, fresh_token: bool, item: str) -> PollStep | None:
    if ans.status == 404:  # the item appears only once EC2 has something to say
        return PollStep(retry_after_s=poll_s)
    if ans.status == 401 and not fresh_token:  # the token expired: renew it and ask again at once
        return PollStep(refresh_token=True)
    if ans.status == 401:  # refused a token it just gave: renewing at once again would spin
        return PollStep(refresh_token=True, retry_after_s=poll_s,
                        problem=f"aws metadata server refused a token it had just issued when asked for {item}")
    if ans.status != 200:
        return _unexpected("aws", item, ans, poll_s)
    return None


def decide_aws_action(ans: HttpAnswer, poll_s: float, fresh_token: bool) -> PollStep:
    """The answer to GET spot/instance-action."""
    step = _aws_status(ans, poll_s, fresh_token, "spot/instance-action")
    if step is not None:
        return step
    doc = _json_object(ans.body) or {}
    action, deadline = doc.get("action"), _parse_iso_utc(doc.get("time"))
    if action not in _AWS_ACTIONS or deadline is None:
        return PollStep(problem=f"aws spot/instance-action is not {{action, time}}: {ans.body[:200]!r}",
                        retry_after_s=poll_s)
    return PollStep(notice=Notice("aws", f"EC2 will {action} this spot instance at {doc['time']}", deadline,
                                  ans.body[:500]))


def decide_aws_rebalance(ans: HttpAnswer, poll_s: float, fresh_token: bool) -> PollStep:
    """The answer to GET events/recommendations/rebalance: a higher risk of interruption, no date."""
    step = _aws_status(ans, poll_s, fresh_token, "events/recommendations/rebalance")
    if step is not None:
        return step
    doc = _json_object(ans.body) or {}
    if _parse_iso_utc(doc.get("noticeTime")) is None:
        return PollStep(problem=f"aws rebalance recommendation has no noticeTime: {ans.body[:200]!r}",
                        retry_after_s=poll_s)
    return PollStep(notice=Notice(
        "aws", f"EC2 rebalance recommendation for this spot instance (at {doc['noticeTime']})", None, ans.body[:500]))


# ---- GCP ----------------------------------------------------------------------------------


def gcp_query(etag: str | None, wait_s: int) -> str:
    """A plain read while the ETag is unknown; then a GET held until the value moves past it.

    Anchoring the wait on the ETag means a change between two requests is never missed.
    """
    if etag is None:
        return GCP_PREEMPTED_PATH
    return GCP_PREEMPTED_PATH + "?" + urlencode({"wait_for_change": "true", "last_etag": etag, "timeout_sec": wait_s})


def decide_gcp(ans: HttpAnswer, now_unix_s: float, notice_s: float, poll_s: float) -> PollStep:
    """The answer to GET instance/preempted; `notice_s` is how long a preempted VM has left."""
    value = ans.body.strip().upper() if ans.status == 200 else ""
    if value == "TRUE":
        return PollStep(notice=Notice("gcp", f"Compute Engine preempted this VM; it stops within {notice_s:g} s",
                                      now_unix_s + notice_s, ans.body[:500]))
    if value == "FALSE":  # without an ETag there is nothing to hold a GET on: poll instead
        etag = ans.headers.get("etag") or None
        return PollStep(etag=etag, retry_after_s=0.0 if etag else poll_s)
    return _unexpected("gcp", "instance/preempted", ans, poll_s)  # 503 during maintenance, too


# ---- Azure --------------------------------------------------------------------------------


def parse_azure_vm_name(ans: HttpAnswer) -> str | None:
    """The answer to GET compute/name?format=text, if it looks like a VM name: a wrong name would
    hide this VM's events, so anything else leaves the name unknown (and every event counts)."""
    name = ans.body.strip()
    return name if ans.status == 200 and _VM_NAME.fullmatch(name) else None


def decide_azure(ans: HttpAnswer, now_unix_s: float, vm_name: str | None, event_types: Sequence[str],
                 poll_s: float) -> PollStep:
    """The answer to GET scheduledevents: the earliest event of `event_types` that hits this VM.

    With `vm_name` unknown every such event counts: a needless drain costs less than a missed one.
    """
    if ans.status != 200:
        return _unexpected("azure", "scheduledevents", ans, poll_s)
    events = (_json_object(ans.body) or {}).get("Events")
    if not isinstance(events, list):
        return PollStep(problem=f"azure scheduledevents has no Events list: {ans.body[:200]!r}", retry_after_s=poll_s)
    hits = []
    for ev in events:
        if not isinstance(ev, dict) or ev.get("EventType") not in event_types:
            continue
        resources = ev.get("Resources")
        if vm_name is not None and isinstance(resources, list) and vm_name not in resources:
            continue
        not_before = ev.get("NotBefore") or ""
        # Blank once the event has started; an unreadable date is taken as now, the safe side.
        deadline = (_parse_http_date(not_before) if isinstance(not_before, str) else None) or now_unix_s
        hits.append((deadline, ev))
    if not hits:
        return PollStep(retry_after_s=poll_s)
    deadline, ev = min(hits, key=lambda hit: hit[0])
    reason = (f"Azure scheduled {ev['EventType']} event {ev.get('EventId')} ({ev.get('EventStatus')}), "
              f"not before {ev.get('NotBefore') or 'now'}")
    return PollStep(notice=Notice("azure", reason, deadline, ans.body[:500]))
